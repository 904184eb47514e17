"""The compiler layer: the registry and its order, pass-list resolution, ``build_pipeline``'s arguments."""

import dataclasses

import pytest
import torch

from graph_trainer.config import Compile, _flag_doc, project_sections
from graph_trainer.model import BlockLayout, block_layout, build_model, model_args
from graph_trainer.compiler.memory_policy import Levers
from graph_trainer.compiler.passes import ORDER
from graph_trainer.compiler.pipeline import build_pipeline
from graph_trainer.compiler.registry import PassContext, option_sections, registry, resolve

DEFAULT_ORDER = list(registry())
RMSNORM, POINTWISE = "annotate_rmsnorm_for_regional_inductor", "annotate_pointwise_for_regional_inductor"


def _compile(**groups):
    """A ``Compile`` with top-level fields and ``group={field: value}`` overrides."""
    return Compile(**{k: dataclasses.replace(getattr(Compile(), k), **v) if isinstance(v, dict) else v
                      for k, v in groups.items()})


def _names(uses_flex_attention=False, **cfg):
    """The pass names :func:`resolve` picks for ``_compile(**cfg)``."""
    return resolve(PassContext(_compile(**cfg), uses_flex_attention=uses_flex_attention))


def _options(cfg, *args, **kw):
    return {s.name: s.options for s in build_pipeline(cfg, *args, **kw)}


def test_block_options_become_the_pass_arguments_of_the_8b():
    """Block counts become parameter / collective counts (Llama3: the embedding, then 9 per block)."""
    layout = block_layout(build_model(model_args("8B"), "meta"))
    assert layout == BlockLayout(params_before=1, params_per_block=9, n_blocks=32)
    cfg = _compile(inductor_compilation="full", sac={"save": "matmuls"},
                   fsdp={"bucket_blocks": 2, "keep_last_blocks": 12})
    assert (steps := _options(cfg, layout))["reshard_after_forward"] == {"first_params": 1 + 9 * 20}
    assert steps["bucket_collectives"] == {"bucket_size": 18, "reduce_scatter_in_flight": 1}
    assert steps["sac_recompute"] == {"save_ops": [torch.ops.aten.mm.default]}
    assert steps["full_inductor"] == {"inductor_configs": None, "pin_collectives": True}
    # two blocks ahead, TP's collectives a matmul ahead (no TP group here); [compile.overlap_collectives]
    assert steps["overlap_collectives"] == {"ag_window": 18, "tp_lead": 1, "tp_group_name": None}
    assert list(steps) == [n for n in DEFAULT_ORDER if n in steps]
    assert _options(_compile(overlap_collectives={"ag_window": 9, "tp_lead": 0}),
                    layout)["overlap_collectives"] == {"ag_window": 9, "tp_lead": 0, "tp_group_name": None}
    # levers on auto: without the policy's choice the leanest; with it, the choice
    default = _options(Compile(), layout)
    assert default["reshard_after_forward"] == default["sac_recompute"] == {} and "bucket_collectives" not in default
    chosen = _options(Compile(), layout, levers=Levers("all", 32, 2))
    assert chosen["sac_recompute"] == {"save_all": True} and chosen["reshard_after_forward"] == {"first_params": 1}
    assert chosen["bucket_collectives"] == {"bucket_size": 18, "reduce_scatter_in_flight": 1}
    with pytest.raises(ValueError, match="block layout"):
        build_pipeline(cfg)


def test_rmsnorm_options_and_deterministic_pick():
    cfg = _compile(numerics_changing_optim=True, rmsnorm={"inductor_configs": {"split_reductions": False}})
    opts = _options(cfg)[RMSNORM]
    assert opts["inductor_configs"] == {"split_reductions": False} and opts["candidate_configs"]
    for off in (dict(deterministic=True), dict()):
        c = _compile(numerics_changing_optim=True, rmsnorm={"tune": bool(off)})  # tune on only with deterministic
        assert _options(c, **off)[RMSNORM]["candidate_configs"] is None
    # JSON strings (a Compile built without parse_args) are read too
    c = _compile(inductor_compilation="full", full_inductor={"configs": '{"max_autotune": false}'})
    assert _options(c)["full_inductor"]["inductor_configs"] == {"max_autotune": False}


def test_registry_and_order():
    """Every ORDER module declares a PASS; option fields are flags with help; cleanup first, CUDA graphs last."""
    assert [spec.aliases[0] for spec in registry().values()] == ORDER
    for section, cls in option_sections():
        assert isinstance(getattr(Compile(), section), cls) and f"compile.{section}" in project_sections()
        for f in dataclasses.fields(cls):
            assert _flag_doc(cls, f.name), f"{cls.__name__}.{f.name} has no docstring (its --help text)"
    assert set(_options(_compile(numerics_changing_optim=True, passes="cudagraph,async_tp"))) >= {
        RMSNORM, "cudagraph", "async_tp"}
    order = DEFAULT_ORDER  # its invariants, not its full list: a new pass adds a line to ORDER only
    assert order[0] == "remove_dead_code" and order[-1] == "cudagraph"
    annotations = [i for i, n in enumerate(order) if n.startswith("annotate_")]
    assert annotations and max(annotations) < order.index("regional_inductor") < order.index("full_inductor")
    assert order.index("sac_recompute") < order.index("reshard_after_forward") < order.index("bucket_collectives")


@pytest.mark.parametrize("name, inductor, before, wrong, match", [
    ("annotate_residual_rmsnorm_for_regional_inductor", "regional", "regional_inductor", "full", "regional_inductor"),
    ("isolate_rmsnorm", "full", "full_inductor", "regional", "full_inductor"),
])
def test_opt_in_pass_needs_the_flag_and_its_inductor_mode(name, inductor, before, wrong, match):
    names = list(_options(_compile(inductor_compilation=inductor, numerics_changing_optim=True, passes=name)))
    assert names.index(name) == names.index(before) - 1
    assert name not in _options(_compile(inductor_compilation=inductor, numerics_changing_optim=True))
    with pytest.raises(ValueError, match="numerics_changing_optim"):
        build_pipeline(_compile(inductor_compilation=inductor, passes=name))
    with pytest.raises(ValueError, match=match):
        build_pipeline(_compile(inductor_compilation=wrong, numerics_changing_optim=True, passes=name))


def test_resolve_defaults_and_additions():
    """Additions relative to the passes that run without Inductor; aliases; disabled passes."""
    base = _names(inductor_compilation="none")
    assert base == [n for n in DEFAULT_ORDER if n in base]
    assert not any(registry()[n].compiles or registry()[n].changes_numerics for n in base)
    assert "bucket_collectives" in base  # bucket_blocks auto: the memory policy may pick 0 (then it is dropped)
    assert _names(inductor_compilation="regional") == base + ["regional_inductor"]
    assert _names(inductor_compilation="full") == base + ["full_inductor"]
    # numerics_changing_optim: the RMSNorm regions; full inductor compiles every norm anyway
    assert _names(numerics_changing_optim=True) == base + [RMSNORM, "regional_inductor"]
    assert RMSNORM not in _names(numerics_changing_optim=True, inductor_compilation="full")
    assert _names(numerics_changing_optim=True, passes="cudagraph", uses_flex_attention=True) \
        == base + ["annotate_flex_attention_for_regional_inductor", RMSNORM, "regional_inductor", "cudagraph"]
    assert _names(numerics_changing_optim=True, passes="pointwise, dce", disable_passes="remove_noop_views") \
        == [n for n in base if n != "remove_noop_views"] + [RMSNORM, POINTWISE, "regional_inductor"]
    assert ["bucket_collectives" in _names(fsdp={"bucket_blocks": n}) for n in (0, 1)] == [False, True]
    assert _names(numerics_changing_optim=True, passes="regional_inductor, annotate_rmsnorm, remove_dead_code_pass") \
        == _names(numerics_changing_optim=True)
    disabled = ["remove_noop_views", RMSNORM, "overlap_collectives"]
    assert _names(numerics_changing_optim=True, disable_passes=",".join(disabled)) \
        == [n for n in _names() if n not in disabled]


@pytest.mark.parametrize("match, cfg", [
    ("unknown graph pass 'nope'.*remove_dead_code", dict(passes="nope")),
    ("inductor_compilation must be one of", dict(inductor_compilation="max")),
    ("only has an effect when regional_inductor runs after it",
     dict(numerics_changing_optim=True, disable_passes="regional_inductor")),
    ("changes numerics", dict(passes="annotate_rmsnorm")),
])
def test_resolve_errors(match, cfg):
    with pytest.raises(ValueError, match=match):
        _names(**cfg)
