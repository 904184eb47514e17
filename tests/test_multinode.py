"""Several hosts via torchrun's rendezvous: the pre-check counts NNODES x NGPU; 2 x 1 ranks == 1 x 2."""

import os
import signal
import subprocess

import pytest

from graph_trainer import config
from graph_trainer.errors import UserError
from graph_trainer.metrics import read_metrics

import _early  # tests/ is on sys.path
from _runs import DEBUG, LAUNCH_VARS, REPO, SMALL, bitwise_flags, fixed_port, launch_env


def test_precheck_world_is_nnodes_x_ngpu(monkeypatch, capsys):
    debug = ["--job.config_file", DEBUG]
    assert config.launch_world_size({"NNODES": "2", "NGPU": "8", "NODE_RANK": "1"}) == 16
    assert config.launch_world_size({}) == 1
    for bad, name in (({"NNODES": "0"}, "NNODES=0"), ({"NODE_RANK": "1"}, "NODE_RANK=1"),
                      ({"NGPU": "2.5"}, "NGPU=2.5"), ({"NNODES": "2", "NODE_RANK": "-1"}, "NODE_RANK=-1")):
        with pytest.raises(UserError, match=name):
            config.launch_world_size(bad)
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NGPU", "2")
    assert [config._check_main([*debug, "--parallelism.data_parallel_shard_degree", n]) for n in ("4", "2")] == [0, 2]
    assert "NNODES x NGPU=2x2=4" in capsys.readouterr().err


@pytest.mark.slow
@_early.uses("bitwise_gloo2")
def test_two_hosts_bitwise_one_host(tmp_path):
    """Bitwise each step and the final state; global rank 0 (writing metrics.jsonl) is on NODE_RANK=0 (started last)."""
    one_host, _, _ = _early.result("bitwise_gloo2")  # run a: FSDP2 on 2 forked ranks, one host, 4 steps
    ref_rows, ref_summary = read_metrics(str(one_host / "metrics.jsonl"))  # 4 rows: tests/test_determinism.py
    endpoint = f"127.0.0.1:{fixed_port()}"  # the NODE_RANK=0 host's torchrun serves it
    procs, logs = {}, {node: tmp_path / f"node{node}.log" for node in (0, 1)}
    try:
        for node in (1, 0):  # NODE_RANK=1 first: a first-come rendezvous would make it rank 0
            with open(logs[node], "w") as log:  # a file, not a pipe: no host blocks on a full pipe
                procs[node] = subprocess.Popen(
                    ["bash", "run_train.sh", *SMALL, "--training.steps", "4", "--debug.state_hashes", *bitwise_flags(4),
                     "--job.dump_folder", str(tmp_path / f"node{node}")],
                    cwd=REPO, env=launch_env(NNODES="2", NODE_RANK=str(node), NGPU="1", RDZV_ENDPOINT=endpoint),
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for p in procs.values():
            p.wait(timeout=900)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    out = {node: path.read_text() for node, path in logs.items()}
    for node, p in procs.items():
        assert p.returncode == 0, f"node {node}:\n" + out[node][-3000:]
    assert "world 2" in out[0] and "world 2" in out[1]
    assert not (tmp_path / "node1" / "metrics.jsonl").exists()  # rank 0 is on NODE_RANK=0
    rows, summary = read_metrics(os.path.join(tmp_path / "node0", "metrics.jsonl"))
    assert [(x["loss"], x["grad_norm"]) for x in rows] == [(x["loss"], x["grad_norm"]) for x in ref_rows]  # bitwise
    assert summary["state_hashes"] == ref_summary["state_hashes"]
