"""`pagelm warm`: without a model it runs a tiny model of every architecture, so every architecture's layer
kernels are compiled ahead of time."""

import pagelm.models
from pagelm.tools.warm import tiny_shapes, warm_architectures


def test_every_architecture_has_a_tiny_shape_to_warm():
    shapes = tiny_shapes()
    for module in pagelm.models._architectures():
        assert set(module.GGUF_ARCHITECTURES) & set(shapes), f"{module.__name__}: no tiny synth shape to warm"


def test_warming_runs_a_first_step_of_each(monkeypatch):
    import pagelm.tools.warm as warm

    stepped = []
    run = warm.warm_model
    monkeypatch.setattr(warm, "warm_model", lambda path, *a: stepped.append(path) or run(path, *a))
    warm_architectures("mapped")
    assert [p.rsplit("/", 1)[-1] for p in stepped] == [f"{name}.gguf" for name in tiny_shapes().values()]
