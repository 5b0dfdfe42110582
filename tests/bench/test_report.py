"""The pure parts of `pagelm bench` reporting: markdown tables and the generated block of results.md."""

import pytest

from pagelm.bench.report import BLOCK_BEGIN, BLOCK_END, markdown_table, replace_generated_block


def test_markdown_table_aligns_columns_and_escapes_pipes():
    table = markdown_table(["model", "MiB"], [["a|b", "485"], ["c", "12"]], align="lr")
    assert table.splitlines() == ["| model | MiB |", "|---|---:|", "| a\\|b | 485 |", "| c | 12 |"]


def test_markdown_table_rejects_a_short_row():
    with pytest.raises(ValueError):
        markdown_table(["a", "b"], [["only one"]])


def test_block_is_appended_when_absent_and_the_rest_is_kept():
    document = "# Measured results\n\n## Hand-run section\n\ntext\n"
    out = replace_generated_block(document, "generated v1")
    assert out.startswith(document.rstrip("\n"))
    assert out.endswith(f"{BLOCK_BEGIN}\ngenerated v1\n{BLOCK_END}\n")


def test_block_is_replaced_in_place_keeping_text_before_and_after():
    document = f"# Top\n\nbefore\n\n{BLOCK_BEGIN}\nold\nlines\n{BLOCK_END}\n\n## After\n\nafter text\n"
    out = replace_generated_block(document, "new")
    assert out == f"# Top\n\nbefore\n\n{BLOCK_BEGIN}\nnew\n{BLOCK_END}\n\n## After\n\nafter text\n"
    assert replace_generated_block(out, "new") == out  # regenerating is stable


def test_broken_block_is_refused():
    with pytest.raises(ValueError):
        replace_generated_block(f"{BLOCK_END}\n{BLOCK_BEGIN}\n", "x")
    with pytest.raises(ValueError):
        replace_generated_block(f"text\n{BLOCK_BEGIN}\nno end\n", "x")
