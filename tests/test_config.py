"""The config layer: parsing, validation, and every command line the docs and GPU scripts show."""

import json
import os
import re
import shlex

import pytest

from graph_trainer.config import _merged_cls, help_text, parse_args, validate
from graph_trainer.errors import UserError

from _runs import DEBUG, REPO  # tests/ is on sys.path


@pytest.mark.parametrize("flags, needle", [  # flags as shlex.split reads them
    ("--compile.mode fast", "Valid values: eager, jit, aot_fx_trace"),
    ("--compile.mode=fast", "Valid values: eager, jit, aot_fx_trace"),
    ("--model.flavor 9B", "Unknown --model.flavor '9B'"), ("--compile.passes full_inductor", "cannot run together"),
    ("--compile.inductor_compilation partial", "regional, full, none"),
    ("--profiling.enable_profiling --profiling.profile_freq 2", "--profiling.profile_freq (2) must be >="),
    ("--compile.full_inductor.configs '{\"a\": 1}' --compile.mode jit",
     "[compile.full_inductor] is set, but full_inductor does not run"),
    ("--compile.rmsnorm.no-tune", "[compile.rmsnorm] is set, but annotate_rmsnorm_for_regional_inductor does not run"),
    ("--compile.annotate_exact_pointwise.no-lone_casts --compile.inductor_compilation full",
     "[compile.annotate_exact_pointwise] is set, but annotate_exact_pointwise_for_regional_inductor does not run"),
    ("--compile.inductor_compilation full --compile.full_inductor.configs [1]",
     "--compile.full_inductor.configs must be a JSON object"),
    ("--compile.disable_passes nope", "unknown graph pass 'nope'"),
    ("--compile.passes annotate_pointwise", "add --compile.numerics_changing_optim"),
    ("--compile.numerics_changing_optim --compile.inductor_compilation none --compile.passes rmsnorm",
     "only has an effect when regional_inductor runs after it"),
    ("--compile.fsdp.keep_last_blocks 7", "must be in [0, 6] or -1 (auto)"),
    ("--compile.fsdp.bucket_blocks -2", "must be >= 0 (or -1: auto)"),
    ("--compile.fsdp.reduce_scatter_in_flight -1", "reduce_scatter_in_flight must be >= 0"),
    ("--compile.annotate_exact_pointwise.min_ops 0", "min_ops must be >= 1"),
    ("--compile.memory_budget_gib -1", "--compile.memory_budget_gib must be >= 0"),
    ("--compile.sac.save some", "recompute, matmuls, all_but_cheap, all"),
    ("--job.config_file nope.toml", "Config file 'nope.toml' does not exist"),
    ("--compile.numerics_changing_optim --compile.rmsnorm.inductor_configs {oops",
     "rmsnorm.inductor_configs must be a JSON object"),
    ("--compile.numerics_changing_optim --compile.rmsnorm.inductor_configs '{\"not_a_config\": 1}'", "not_a_config"),
])
def test_bad_config_is_rejected(flags, needle):
    with pytest.raises(UserError) as e:
        parse_args(["--job.config_file", DEBUG, *shlex.split(flags)])
    assert needle in str(e.value)


def test_aliases_and_config_names(monkeypatch):
    monkeypatch.setenv("CONFIG", "graph_trainer_llama3_8b")
    cfg = parse_args(["--dataloader.dataset", "c4_test", "--profiler.no-enable_profiling",
                      "--metrics.no-enable_tensorboard", "--comm.trace_buf_size=0"])
    assert cfg.model.flavor == "8B" and cfg.training.seq_len == 8192 and cfg.compile.mode == "aot_fx_trace"
    assert cfg.training.dataset == "c4_test" and cfg.profiling.enable_profiling is False


def test_nested_groups_from_toml_and_cli(tmp_path):
    """[compile.<group>] in TOML and on the CLI (CLI wins); Inductor config tables read as JSON text."""
    toml = tmp_path / "c.toml"
    toml.write_text(open(DEBUG).read() + '\n[compile.fsdp]\nbucket_blocks = 2\nkeep_last_blocks = 1\n'
                    '[compile.full_inductor]\nconfigs = { "max_autotune" = false }\n')
    cfg = parse_args(["--job.config_file", str(toml), "--compile.inductor_compilation", "full",
                      "--compile.fsdp.keep_last_blocks", "3", "--compile.full_inductor.no-pin_collectives"])
    assert (cfg.compile.fsdp.bucket_blocks, cfg.compile.fsdp.keep_last_blocks) == (2, 3)
    assert json.loads(cfg.compile.full_inductor.configs) == {"max_autotune": False}
    assert cfg.compile.full_inductor.pin_collectives is False
    cfg = parse_args(["--job.config_file", DEBUG, "--compile.numerics_changing_optim",
                      "--compile.rmsnorm.inductor_configs", '{"split_reductions": false}'])
    assert json.loads(cfg.compile.rmsnorm.inductor_configs) == {"split_reductions": False}
    # the options of a pass on by default on CUDA pass the check on any host
    cfg = parse_args(["--job.config_file", DEBUG, "--compile.annotate_exact_pointwise.no-lone_casts"])
    assert cfg.compile.annotate_exact_pointwise.lone_casts is False


def test_validate_returns_the_pass_list():
    cfg = parse_args(["--job.config_file", DEBUG, "--compile.numerics_changing_optim",
                      "--compile.passes", "annotate_pointwise", "--compile.disable_passes", "remove_noop_views"])
    names = validate(cfg)
    assert names[-3:] == ["annotate_rmsnorm_for_regional_inductor", "annotate_pointwise_for_regional_inductor",
                          "regional_inductor"]
    assert "remove_noop_views" not in names
    assert validate(parse_args(["--job.config_file", DEBUG, "--compile.mode", "eager"])) == []


@pytest.mark.parametrize("path", ["README.md", "docs/design.md", "tests/test_gpu_tier.py",
                                  "scripts/fusion_report.py", "scripts/project_scale.py"])
def test_documented_commands_parse_and_flags_are_known(path, monkeypatch):
    """The trainer flags a doc, the GPU tier's runs or a script name are spelled as --help spells them; each fenced
    run_train.sh command parses (CONFIG_FILE, else CONFIG, else debug)."""
    text = open(os.path.join(REPO, path)).read()
    known = {f for pair in re.findall(r"^  (--\S+)(?: / (--\S+))?", help_text(_merged_cls()), re.M) for f in pair}
    flags = set(re.findall(r"(--[a-z_]+\.[a-z_][a-z_.-]*[a-z_])", text))
    assert flags, f"{path} names no trainer flag"
    aliases = ("--dataloader.", "--profiler.", "--section.key")  # newer torchtitan spellings; a placeholder
    unknown = sorted(f for f in flags if f not in known and not f.startswith(aliases))
    assert not unknown, f"{path}: unknown flags {unknown}"
    commands = 0
    for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines() if lang in ("", "bash", "sh") else ():
            if "./run_train.sh" not in (line := line.split(" #")[0].strip()):
                continue
            words = shlex.split(line)
            i = next(k for k, w in enumerate(words) if w.endswith("run_train.sh"))
            env, commands = dict(w.split("=", 1) for w in words[:i] if "=" in w), commands + 1
            for key in ("CONFIG", "CONFIG_FILE", "NGPU"):
                monkeypatch.delenv(key, raising=False)
            pre = ["--job.config_file", os.path.join(REPO, env["CONFIG_FILE"]) if "CONFIG_FILE" in env else DEBUG]
            if "CONFIG" in env and "CONFIG_FILE" not in env:
                monkeypatch.setenv("CONFIG", env["CONFIG"])
                pre = []
            parse_args(pre + words[i + 1:])
    assert path != "README.md" or commands >= 5
