"""Every bad input that can be known before start is refused by run_train.sh's pre-check
(``python -m graph_trainer.config``): exit 2, one short message naming the flag or file, no
traceback, and no torchrun worker started. Also ``--help`` without torchrun.

Each case runs the pre-check's entry point (``graph_trainer.config._check_main``, what
``python -m graph_trainer.config`` runs) in this process, with the arguments and
environment run_train.sh gives it; the cases in :data:`LAUNCHED` run the whole
run_train.sh instead: a bad value (the script prints the pre-check's error and exits 2
before torchrun), ``NGPU`` and ``CONFIG_FILE`` (which the script hands to the pre-check),
and a missing config file (which the script refuses itself)."""

import os
import subprocess

import pytest

from _runs import LAUNCH_VARS  # tests/ is on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(REPO, "train_configs", "debug_model.toml")


def _run_sh(args, env=None, timeout=300):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.run(["bash", os.path.join(REPO, "run_train.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)


def _bad_inputs(tmp):
    bad_toml = tmp / "bad.toml"
    bad_toml.write_text('[job]\ndump_folder = "unterminated\n')
    jsonl = tmp / "bad.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"text": tru\n')
    empty = tmp / "empty_tokenizer"
    empty.mkdir()
    out = ["--job.dump_folder", str(tmp / "out")]
    return {
        "unknown flag": ({}, ["--training.stepz", "3", *out], "--training.stepz"),
        "bad value": ({}, ["--compile.mode", "fast", *out], "Valid values: eager, jit, aot_fx_trace"),
        "bad pass name": ({}, ["--compile.disable_passes", "nope", *out], "unknown graph pass 'nope'"),
        "removed flag": ({}, ["--compile.bucket_collectives", "18", *out], "--compile.fsdp.bucket_blocks"),
        "compile.enable": ({}, ["--compile.enable", *out], "--compile.mode jit"),
        "degrees vs NGPU": ({"NGPU": "2"}, ["--parallelism.tensor_parallel_degree", "3", *out], "does not divide NGPU=2"),
        "TOML syntax": ({"CONFIG_FILE": str(bad_toml)}, out, f"{bad_toml}: not valid TOML"),
        "missing config": ({"CONFIG_FILE": str(tmp / "nope.toml")}, out, "does not exist"),
        "missing dataset_path": ({}, ["--training.dataset_path", str(tmp / "nope.jsonl"), *out], "nope.jsonl"),
        "corrupt JSONL": ({}, ["--training.dataset_path", str(jsonl), *out], f"{jsonl}:2"),
        "empty tokenizer folder": ({}, ["--model.hf_assets_path", str(empty), *out], str(empty)),
        "missing load_step": ({}, ["--checkpoint.enable", "--checkpoint.load_step", "7", *out], "step-7"),
    }


CASES = ["unknown flag", "bad value", "bad pass name", "removed flag", "compile.enable", "degrees vs NGPU",
         "TOML syntax", "missing config", "missing dataset_path", "corrupt JSONL",
         "empty tokenizer folder", "missing load_step"]
#: The cases run through the whole run_train.sh (the others: its pre-check, in this process).
LAUNCHED = {"bad value", "degrees vs NGPU", "TOML syntax", "missing config"}


def _precheck(args, env, monkeypatch, capsys):
    """run_train.sh's pre-check in this process: ``(exit code, stdout + stderr)``; the
    config file as the script passes it (CONFIG_FILE, else the debug model)."""
    from graph_trainer import config

    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        if k != "CONFIG_FILE":
            monkeypatch.setenv(k, v)
    capsys.readouterr()
    rc = config._check_main(["--job.config_file", env.get("CONFIG_FILE", DEBUG), *args])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("case", CASES)
def test_bad_input_refused_before_torchrun(case, tmp_path, monkeypatch, capsys):
    env, args, needle = _bad_inputs(tmp_path)[case]
    if case in LAUNCHED:
        r = _run_sh(args, env)
        rc, text = r.returncode, r.stdout + r.stderr
    else:
        rc, text = _precheck(args, env, monkeypatch, capsys)
    assert rc == 2, text[-2000:]
    assert needle in text, text[-2000:]
    assert "Traceback" not in text and "[rank0]" not in text  # no worker was started
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_help_without_torchrun():
    r = _run_sh(["--help"])
    assert r.returncode == 0 and "[rank0]" not in r.stdout
    lines = r.stdout.splitlines()
    assert lines.index("[compile]") < lines.index("[job]")  # the project's flags first
    for flag in ("--compile.mode {eager,jit,aot_fx_trace}", "--compile.fsdp.keep_last_blocks int",
                 "--compile.rmsnorm.tune / --compile.rmsnorm.no-tune", "--training.steps int"):
        assert f"  {flag}" in lines, flag
    i = lines.index("  --compile.fsdp.bucket_blocks int")
    assert "transformer blocks" in lines[i + 1] + lines[i + 2]  # its description follows
    assert "--compile.enable" not in r.stdout  # set by --compile.mode


def test_no_hf_assets_warning_for_the_embedded_tokenizer():
    r = subprocess.run(["python3", "-m", "graph_trainer.config", "--job.config_file",
                        os.path.join(REPO, "train_configs", "debug_model.toml")],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and "HF assets path" not in r.stdout + r.stderr
