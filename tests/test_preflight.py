"""Bad input knowable before start: exit 2, one short message naming it, no traceback, nothing written."""

import subprocess

import pytest

import _early  # tests/ is on sys.path
from _runs import DEBUG, LAUNCH_VARS, REPO, launch_env


def _run_sh(args, env=None, base=None):
    """run_train.sh without the caller's (or ``base``'s) launcher variables, CPU only, plus ``env``."""
    return subprocess.run(["bash", "run_train.sh", *args], capture_output=True, text=True,
                          env=launch_env(base, **(env or {})), timeout=300, cwd=REPO)


#: ``id: (where, env, args, needle)``, env and args space-separated; ``{name}``: a file :func:`_case` writes.
CASES = {
    "unknown flag": ("precheck", "", "--training.stepz 3", "--training.stepz"),
    "compile.enable": ("precheck", "", "--compile.enable", "--compile.mode jit"),
    "TOML syntax": ("precheck", "CONFIG_FILE={bad_toml}", "", "{bad_toml}: not valid TOML"),
    "unknown CONFIG name": ("precheck", "CONFIG=graph_trainer_llama3_70b", "",
                            "CONFIG=graph_trainer_llama3_70b is not a known config name"),
    "missing dataset_path": ("precheck", "", "--training.dataset_path {nope_jsonl}", "{nope_jsonl}"),
    "corrupt JSONL": ("precheck", "", "--training.dataset_path {bad_jsonl}", "{bad_jsonl}:2"),
    "empty tokenizer folder": ("precheck", "", "--model.hf_assets_path {empty}", "{empty}"),
    "missing load_step": ("precheck", "", "--checkpoint.enable --checkpoint.load_step 7", "step-7"),
    "--comm.mode unsupported": ("precheck", "", "--comm.mode local_tensor",
                                "--comm.mode local_tensor (COMM_MODE=local_tensor) is not supported"),
    "fake_collectives checkpoints": ("trainer", "NGPU=2", "--comm.mode fake_collectives --checkpoint.enable",
                                     "--checkpoint.enable cannot be used with COMM_MODE=fake_collectives"),
    "eager replicas x TP": ("precheck", "NGPU=4", "--compile.mode eager --parallelism.data_parallel_shard_degree 1 "
                            "--parallelism.data_parallel_replicate_degree 2 --parallelism.tensor_parallel_degree 2",
                            "torchtitan's DDP refuses TP"),
    "CONFIG_FILE degrees vs NGPU": ("script", "CONFIG_FILE={tp3_toml} NGPU=2", "", "does not divide NGPU=2"),
    "missing CONFIG_FILE": ("script", "CONFIG_FILE={nope_toml}", "", "config file '{nope_toml}' does not exist"),
    "COMM_MODE unsupported": ("script", "COMM_MODE=local_tensor", "", "COMM_MODE=local_tensor is not supported; "
                              "use fake_backend (a dry run) or fake_collectives"),
    "NNODES without RDZV_ENDPOINT": ("script", "NNODES=2", "", "RDZV_ENDPOINT"),
    "NODE_RANK too large": ("script", "NNODES=2 NODE_RANK=2", "", "NODE_RANK=2"),
    "NODE_RANK too large, endpoint": ("script", "NNODES=2 NODE_RANK=2 RDZV_ENDPOINT=127.0.0.1:29500", "",
                                      "NODE_RANK=2"),
    "NNODES not a number": ("script", "NNODES=two", "", "NNODES=two"),
    "RDZV_ENDPOINT without port": ("script", "NNODES=2 RDZV_ENDPOINT=127.0.0.1", "", "RDZV_ENDPOINT=127.0.0.1"),
}


def _case(case, tmp):
    """Case ``case`` of :data:`CASES` with its (and the other cases') files in ``tmp``: ``(env, args, needle)``."""
    files = {k: tmp / k.replace("_", ".") for k in "bad_toml tp3_toml bad_jsonl nope_toml nope_jsonl empty".split()}
    files["bad_toml"].write_text('[job]\ndump_folder = "unterminated\n')
    files["tp3_toml"].write_text(open(DEBUG).read().replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 3"))
    files["bad_jsonl"].write_text('{"text": "fine"}\n{"text": tru\n')
    files["empty"].mkdir()
    _, env, args, needle = CASES[case]
    env = dict(w.format(**files).split("=", 1) for w in env.split())
    args = [a.format(**files) for a in args.split()] + ["--job.dump_folder", str(tmp / "out")]
    return env, args, needle.format(**files)


@_early.job("run_train_script_cases", slow=False)
def _script_cases(tmp, base):
    """The cases refused by run_train.sh itself, each in its folder: ``{case: (folder, needle, result)}``."""
    out = {}
    for i, case in enumerate(c for c, (where, *_) in CASES.items() if where == "script"):
        (folder := tmp / str(i)).mkdir()
        env, args, needle = _case(case, folder)
        out[case] = folder, needle, _run_sh(args, env, base)
    return out


@pytest.mark.parametrize("case", [pytest.param(c, marks=_early.uses("run_train_script_cases")) if w == "script"
                                  else c for c, (w, *_) in CASES.items()])  # run_train.sh's runs start early
def test_bad_input_refused_before_start(case, tmp_path, monkeypatch, capsys):
    if (where := CASES[case][0]) == "script":  # its files and output in the folder of tests/_early.py's run
        tmp_path, needle, r = _early.result("run_train_script_cases")[case]
        rc, text, lines = r.returncode, r.stdout + r.stderr, r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr[-2000:]
    else:  # the pre-check or the trainer's entry point in this process, as run_train.sh calls it
        from graph_trainer import config, train

        env, args, needle = _case(case, tmp_path)
        for k in LAUNCH_VARS:
            monkeypatch.delenv(k, raising=False)
        for k in env.keys() - {"CONFIG_FILE"}:
            monkeypatch.setenv(k, env[k])
        config_file = [] if "CONFIG" in env else ["--job.config_file", env.get("CONFIG_FILE", DEBUG)]
        if where == "trainer":
            monkeypatch.setattr(train, "setup_logging", lambda *a, **k: None)  # this process's log handlers stay
        capsys.readouterr()
        rc = (config._check_main if where == "precheck" else train.main)([*config_file, *args])
        text = "".join(capsys.readouterr())
    assert rc == 2 and needle in text, text[-2000:]
    assert "Traceback" not in text and not (tmp_path / "out").exists()  # nothing started or written


_early.job("run_train_help", lambda tmp, env: _run_sh(["--help"], {"NGPU": "2"}, base=env), slow=False)


@_early.uses("run_train_help")
def test_help_without_torchrun():
    r = _early.result("run_train_help")  # NGPU=2 ./run_train.sh --help: torchrun would print [rank0]: lines
    assert r.returncode == 0 and "[rank0]" not in r.stdout and "--compile.enable" not in r.stdout  # set by the mode
    lines = r.stdout.splitlines()
    assert lines.index("[compile]") < lines.index("[job]")  # the project's flags first
    for flag in ("--compile.mode {eager,jit,aot_fx_trace}", "--compile.fsdp.keep_last_blocks int",
                 "--compile.rmsnorm.tune / --compile.rmsnorm.no-tune", "--training.steps int"):
        assert f"  {flag}" in lines, flag
    i = lines.index("  --compile.fsdp.bucket_blocks int")
    assert "transformer blocks" in lines[i + 1] + lines[i + 2]  # its description follows
