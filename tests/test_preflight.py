"""Every bad input that can be known before start is refused before any worker starts:
exit 2, one short message naming the flag, variable or file, no traceback, nothing written.
Also ``--help`` without torchrun. (What the parser rejects, message by message:
tests/test_config.py's table; bad data met late by the trainer: tests/test_data.py.)

Each case of :data:`CASES` says where it is refused, and runs there:

* ``precheck``: run_train.sh's pre-check (``python -m graph_trainer.config``, i.e.
  ``graph_trainer.config._check_main``), in this process, with the arguments and
  environment the script gives it;
* ``trainer``: the trainer's entry point (``graph_trainer.train.main``), in this process:
  ``COMM_MODE=fake_backend / fake_collectives`` run_train.sh starts it without the pre-check;
* ``script``: the whole run_train.sh, for what the script refuses itself (its launcher
  variables, a missing config file) and once for what it hands to the pre-check (the
  degrees of a ``CONFIG_FILE`` against ``NGPU``, and the pre-check's message and exit code).
"""

import os
import subprocess

import pytest

from _runs import LAUNCH_VARS, launch_env  # tests/ is on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(REPO, "train_configs", "debug_model.toml")


def _run_sh(args, env=None, timeout=300):
    """run_train.sh without the caller's launcher variables, CPU only, plus ``env``."""
    return subprocess.run(["bash", os.path.join(REPO, "run_train.sh"), *args], capture_output=True, text=True,
                          env=launch_env(**(env or {})), timeout=timeout, cwd=REPO)


def _files(tmp):
    """The bad files of the cases, written into ``tmp``."""
    bad_toml = tmp / "bad.toml"
    bad_toml.write_text('[job]\ndump_folder = "unterminated\n')
    tp3 = tmp / "tp3.toml"  # the debug config with 3-way TP: refused against NGPU=2
    tp3.write_text(open(DEBUG).read().replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 3"))
    jsonl = tmp / "bad.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"text": tru\n')
    (tmp / "empty_tokenizer").mkdir()
    return {"bad_toml": bad_toml, "tp3": tp3, "jsonl": jsonl, "empty": tmp / "empty_tokenizer",
            "nope_toml": tmp / "nope.toml", "nope_jsonl": tmp / "nope.jsonl"}


#: ``id: (where, env, args, needle)``; ``{name}`` in env, args and needle: a file of :func:`_files`.
CASES = {
    "unknown flag": ("precheck", {}, ["--training.stepz", "3"], "--training.stepz"),
    "compile.enable": ("precheck", {}, ["--compile.enable"], "--compile.mode jit"),
    "TOML syntax": ("precheck", {"CONFIG_FILE": "{bad_toml}"}, [], "{bad_toml}: not valid TOML"),
    "unknown CONFIG name": ("precheck", {"CONFIG": "graph_trainer_llama3_70b"}, [],
                            "CONFIG=graph_trainer_llama3_70b is not a known config name"),
    "missing dataset_path": ("precheck", {}, ["--training.dataset_path", "{nope_jsonl}"], "{nope_jsonl}"),
    "corrupt JSONL": ("precheck", {}, ["--training.dataset_path", "{jsonl}"], "{jsonl}:2"),
    "empty tokenizer folder": ("precheck", {}, ["--model.hf_assets_path", "{empty}"], "{empty}"),
    "missing load_step": ("precheck", {}, ["--checkpoint.enable", "--checkpoint.load_step", "7"], "step-7"),
    "--comm.mode unsupported": ("precheck", {}, ["--comm.mode", "local_tensor"],
                                "--comm.mode local_tensor (COMM_MODE=local_tensor) is not supported"),
    "fake_collectives checkpoints": ("trainer", {"NGPU": "2"},
                                     ["--comm.mode", "fake_collectives", "--checkpoint.enable"],
                                     "--checkpoint.enable cannot be used with COMM_MODE=fake_collectives"),
    "CONFIG_FILE degrees vs NGPU": ("script", {"CONFIG_FILE": "{tp3}", "NGPU": "2"}, [], "does not divide NGPU=2"),
    "missing CONFIG_FILE": ("script", {"CONFIG_FILE": "{nope_toml}"}, [], "config file '{nope_toml}' does not exist"),
    "COMM_MODE unsupported": ("script", {"COMM_MODE": "local_tensor"}, [],
                              "COMM_MODE=local_tensor is not supported; use fake_backend (a dry run) or "
                              "fake_collectives"),
    "NNODES without RDZV_ENDPOINT": ("script", {"NNODES": "2"}, [], "RDZV_ENDPOINT"),
    "NODE_RANK too large": ("script", {"NNODES": "2", "NODE_RANK": "2"}, [], "NODE_RANK=2"),
    "NODE_RANK too large, endpoint": ("script", {"NNODES": "2", "NODE_RANK": "2",
                                                 "RDZV_ENDPOINT": "127.0.0.1:29500"}, [], "NODE_RANK=2"),
    "NNODES not a number": ("script", {"NNODES": "two"}, [], "NNODES=two"),
    "RDZV_ENDPOINT without port": ("script", {"NNODES": "2", "RDZV_ENDPOINT": "127.0.0.1"}, [],
                                   "RDZV_ENDPOINT=127.0.0.1"),
}


def _in_process(where, env, args, monkeypatch, capsys):
    """The pre-check or the trainer's entry point in this process, with ``env`` over no
    launcher variables and the config file as run_train.sh passes it (``CONFIG_FILE``, else
    ``CONFIG`` resolved by the entry point, else the debug model): ``(exit code, output)``."""
    from graph_trainer import config, train

    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        if k != "CONFIG_FILE":
            monkeypatch.setenv(k, v)
    config_file = [] if "CONFIG" in env else ["--job.config_file", env.get("CONFIG_FILE", DEBUG)]
    if where == "trainer":
        monkeypatch.setattr(train, "setup_logging", lambda *a, **k: None)  # this process's log handlers stay
    entry = config._check_main if where == "precheck" else train.main
    capsys.readouterr()
    rc = entry([*config_file, *args])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_refused_before_start(case, tmp_path, monkeypatch, capsys):
    files = _files(tmp_path)
    where, env, args, needle = CASES[case]
    env = {k: v.format(**files) for k, v in env.items()}
    args = [a.format(**files) for a in args] + ["--job.dump_folder", str(tmp_path / "out")]
    needle = needle.format(**files)
    if where == "script":
        r = _run_sh(args, env)
        rc, text = r.returncode, r.stdout + r.stderr
        lines = r.stderr.strip().splitlines()
        assert lines and lines[0].startswith("error: ") and needle in lines[0], r.stderr[-2000:]
        assert len(lines) == 1, r.stderr[-2000:]  # one paragraph, nothing from torchrun
    else:
        rc, text = _in_process(where, env, args, monkeypatch, capsys)
    assert rc == 2, text[-2000:]
    assert needle in text, text[-2000:]
    assert "Traceback" not in text and "[rank0]" not in text  # no worker was started
    assert not (tmp_path / "out").exists()


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


def test_no_hf_assets_warning_for_the_embedded_tokenizer(monkeypatch, capsys, caplog):
    """The debug config's ``hf_assets_path = "embedded"`` passes the pre-check without
    torchtitan's warning about a missing HF assets folder (run_train.sh runs it in the
    repository)."""
    from graph_trainer import config

    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(REPO)
    assert config._check_main(["--job.config_file", DEBUG]) == 0
    out = capsys.readouterr()
    assert "HF assets path" not in out.out + out.err + caplog.text
