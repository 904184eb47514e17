"""scripts/bench_matmuls.py (a step's matmuls, warm and cold L2) on the CPU."""

import pytest
from _scripts import load_script

bench_matmuls = load_script("bench_matmuls")


def test_shapes_follow_the_flavor_and_tensor_parallelism():
    one = {name: (i, o, calls) for name, i, o, calls in bench_matmuls.linear_shapes("1B")}
    assert one["w1"] == (2048, 8192, 16) and one["wk"] == (2048, 512, 16) and one["output"] == (2048, 128256, 1)
    tp2 = {name: (i, o) for name, i, o, _ in bench_matmuls.linear_shapes("1B", tp=2)}
    assert tp2["w1"] == (2048, 4096) and tp2["w2"] == (4096, 2048) and tp2["output"] == (2048, 64128)
    with pytest.raises(bench_matmuls.UserError, match="--tp 3 does not divide wq's out dimension"):
        bench_matmuls.linear_shapes("1B", tp=3)


def test_rows_and_step_sum_on_cpu():
    rows = bench_matmuls.bench("debugmodel", tokens=16, iters=1, flush_mib=1, dtype=bench_matmuls.torch.float32)
    assert len(rows) == 8 * 3 and all(r["ms_warm"] > 0 and r["ms_cold"] > 0 for r in rows)
    dw = next(r for r in rows if r["linear"] == "w2" and r["op"].startswith("dW"))
    assert (dw["m"], dw["k"]) == (256, 16) and dw["calls"] == 6  # [out, tokens] @ [tokens, in]: debugmodel's 6 blocks
    md = bench_matmuls.markdown(rows)
    warm = sum(r["ms_warm"] * r["calls"] for r in rows)
    assert f"per step (calls × ms): warm {warm:.2f} ms" in md and md.count("\n| w") == 21


@pytest.mark.parametrize("argv, message", [(["--flavor", "nope"], "--flavor nope: not one of"),
                                           (["--tokens", "0"], "must be >= 1"),
                                           (["--tp", "3"], "--tp 3 does not divide")])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    try:
        code = bench_matmuls.main(argv + ["--iters", "1"])
    except SystemExit as e:  # argparse's error
        code = e.code
    assert code == 2 and message in capsys.readouterr().err
