"""`strata plan`: the engine's ledger, with the engine's knobs."""

from strata_jax.quantize import quantize_checkpoint
from strata_runtime.cli import main
from tests.helpers import tiny_config, write_checkpoint


def test_plan_prints_the_engine_ledger_with_its_knobs(tmp_path, capsys):
    cfg = tiny_config("mixtral", hidden_size=128, expert_intermediate_size=128, head_dim=32,
                      num_experts=4)
    write_checkpoint(cfg, tmp_path / "float", seed=1)
    quantize_checkpoint(tmp_path / "float", tmp_path / "q", experts="int4-rtn", dense="int8",
                        progress=False)
    args = ["plan", str(tmp_path / "q"), "--hbm", "1GiB", "--max-len", "64"]
    assert main(args) == 0
    packed = capsys.readouterr().out
    assert "fully resident" in packed
    assert main([*args, "--dequant", "host"]) == 0
    bf16 = capsys.readouterr().out
    assert "96.00 KiB each" in bf16 and "96.00 KiB each" not in packed  # 3 x 128 x 128 bf16
    tight = ["plan", str(tmp_path / "float"), "--hbm", "257.6MiB", "--max-len", "64",
             "--batch-capacity", "1", "--staging-slots", "1"]
    assert main(tight) == 0
    assert "staging (2 x 1 experts)" in capsys.readouterr().out
    assert main([*tight[:-2], "--staging-slots", "0"]) == 2
    assert main(["plan", str(tmp_path / "float"), "--hbm", "1MiB"]) == 2
    assert "too small" in capsys.readouterr().err
