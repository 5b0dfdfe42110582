"""The comparison rules of `pagelm bench scenarios`, on made-up observations (no server)."""

from pagelm.bench.scenarios import SCENARIOS, Observation, Run, differences, scenario_table, summary_line
from pagelm.bench.server import ServerConfig

DENSE_ON, MAPPED_ON = ServerConfig("dense", True), ServerConfig("mapped", True)
DENSE_OFF, MAPPED_OFF = ServerConfig("dense", False), ServerConfig("mapped", False)
ANSWER = {"content": "blue", "reasoning": "", "prompt_tokens": 12, "completion_tokens": 3}
ON, OFF = {"lookups": 1, "hits": 1, "tokens_reused": 7}, {"lookups": 0, "hits": 0, "tokens_reused": 0}


def run(config, output=ANSWER, cache=None, counters=None, run_number=1, skipped=None):
    cache = cache if cache is not None else {"cached_tokens": 7 if config.prefix_cache else 0}
    counters = counters if counters is not None else (ON if config.prefix_cache else OFF)
    return Run(config, run_number, Observation(dict(output), dict(cache), skipped=skipped), dict(counters))


def test_there_are_eleven_scenarios():
    assert len(SCENARIOS) == 11


def test_cache_counters_may_differ_between_cache_on_and_off():
    runs = [run(c) for c in (DENSE_ON, MAPPED_ON, DENSE_OFF, MAPPED_OFF)]
    assert differences(runs) == []


def test_content_differing_between_modes_is_reported():
    runs = [run(DENSE_ON), run(MAPPED_ON, output={**ANSWER, "content": "green"})]
    [reason] = differences(runs)
    assert "mapped, cache on run 1" in reason and "content" in reason


def test_cache_counters_differing_within_one_cache_setting_are_reported():
    runs = [run(DENSE_ON), run(MAPPED_ON, counters={**ON, "hits": 0}), run(DENSE_OFF), run(MAPPED_OFF)]
    [reason] = differences(runs)
    assert "cache counters" in reason


def test_a_later_run_is_compared_too():
    runs = [run(DENSE_ON), run(DENSE_ON, output={**ANSWER, "completion_tokens": 4}, run_number=2)]
    assert differences(runs) and "run 2" in differences(runs)[0]


def test_skipped_everywhere_agrees_but_skipped_somewhere_differs():
    skipped = [run(c, output={}, cache={}, counters=OFF, skipped="no vision") for c in (DENSE_ON, MAPPED_ON)]
    assert differences(skipped) == []
    assert differences([skipped[0], run(MAPPED_ON)]) == ["skipped on some configurations only"]


def test_table_and_summary_count_differing_and_skipped():
    results = {"same": [run(DENSE_ON), run(MAPPED_ON)],
               "differs": [run(DENSE_ON), run(MAPPED_ON, output={**ANSWER, "content": "x"})],
               "image": [run(c, output={}, cache={}, counters=OFF, skipped="no vision") for c in (DENSE_ON, MAPPED_ON)]}
    table = scenario_table(results)
    assert "| same | same |" in table and "| differs | DIFFERS |" in table and "| image | skipped |" in table
    assert summary_line(results, 2) == "differing scenarios: 1 of 3 in 2 runs (1 skipped)"


def test_a_request_failing_everywhere_is_same_but_noted():
    failed = {"status": 400, "error": "the prompt is too long"}
    table = scenario_table({"long": [run(DENSE_ON, output=failed), run(MAPPED_ON, output=failed)]})
    assert "| long | same |" in table and "HTTP 400: the prompt is too long" in table
