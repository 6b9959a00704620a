"""The `strata` command line: plan's ledger, every engine knob a flag, text generation
through the tokenizer, timing apart from compilation, the persistent compilation cache."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

import strata_jax
from strata_jax import __version__
from strata_jax.formats.tokenizer import byte_level_files, load_tokenizer
from strata_jax.ops.int4_kernel import Int4Tiles
from strata_jax.step.sampling import SamplingParams
from strata_jax.tools.quantize import quantize_checkpoint
from strata_runtime.cli.engine_flags import resident_config
from strata_runtime.cli.main import build_parser, engine_config, main
from strata_runtime.engine.compile_cache import ENV as CACHE_ENV
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
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
    assert main([*args, "--dequant", "host", "--workspace", "64MiB"]) == 0
    bf16 = capsys.readouterr().out
    assert "96.00 KiB each" in bf16 and "96.00 KiB each" not in packed  # 3 x 128 x 128 bf16
    tight = ["plan", str(tmp_path / "float"), "--hbm", "257.6MiB", "--max-len", "64",
             "--batch-capacity", "1", "--workspace", "256MiB", "--staging-slots", "1"]
    assert main(tight) == 0
    assert "staging (2 x 1 experts)" in capsys.readouterr().out
    assert main([*tight[:-2], "--staging-slots", "0"]) == 2
    assert main(["plan", str(tmp_path / "float"), "--hbm", "1MiB", "--workspace", "0"]) == 2
    assert "too small" in capsys.readouterr().err


# --- strata generate: text, flags, timing, the compilation cache ------------------------------

FIELD_FLAGS = {  # field: (argv, the value engine_config must give); every field, non-default
    "hbm_budget": (["--hbm", "8GB"], "8GB"),
    "host_budget": (["--host-mem", "1.5GiB"], "1.5GiB"),
    "batch_capacity": (["--batch-capacity", "3"], 3),
    "max_len": (["--max-len", "96"], 96),
    "prefill_rows": (["--prefill-rows", "4"], 4),
    "prefill_chunk": (["--prefill-chunk", "32"], 32),
    "expert_devices": (["--expert-devices", "2"], 2),
    "workspace": (["--workspace", "64MiB"], "64MiB"),
    "predictor": (["--predictor", "none"], "none"),
    "policy": (["--policy", "lru"], "lru"),
    "cache_fraction": (["--cache-fraction", "0.5"], 0.5),
    "cache_admit": (["--cache-admit", "always"], "always"),
    "rebalance_every": (["--rebalance-every", "7"], 7),
    "hysteresis": (["--hysteresis", "0.3"], 0.3),
    "heat_decay": (["--heat-decay", "0.5"], 0.5),
    "timeline": (["--timeline"], True),
    "record_trace": (["--record-trace", "run.npz"], "run.npz"),
    "dequant": (["--dequant", "host"], "host"),
    "fetch_threads": (["--fetch-threads", "2"], 2),
    "disk_lookahead": (["--no-disk-lookahead"], False),
    "read_ahead": (["--read-ahead", "3"], 3),
    "resident_experts": (["--resident-experts", "5"], 5),
    "host_experts": (["--host-experts", "6"], 6),
    "heat_file": (["--heat", "HEAT"], "HEAT"),
    "staging_slots": (["--staging-slots", "2"], 2),
    "row_chunks": (["--no-row-chunks"], False),
    "int4_tiles": (["--int4-tiles", "rows=128,stages=3,f16=false"],
                   Int4Tiles(rows=128, stages=3, f16=False)),
    "weight_layout": (["--weight-layout", "rows"], "rows"),
    "miss": (["--miss", "auto"], "auto"),
    "miss_rates": (["--miss-rates", "link=50,host=40"], "link=50,host=40"),
    "host_threads": (["--host-threads", "3"], 3),
    "replay_trace": (["--replay-trace", "run.npz"], "run.npz"),
}


def test_every_engine_config_field_is_a_flag(tmp_path):
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert FIELD_FLAGS.keys() == fields.keys()  # a new knob needs its row here (and a flag)
    heat = tmp_path / "heat.json"
    heat.write_text("{}")
    for command in ("generate", "plan"):
        argv = [command, "CKPT"]
        for flags, _ in FIELD_FLAGS.values():
            argv += [str(heat) if f == "HEAT" else f for f in flags]
        config = engine_config(build_parser().parse_args(argv))
        for name, (_, want) in FIELD_FLAGS.items():
            want = str(heat) if want == "HEAT" else want
            assert getattr(config, name) == want != fields[name].default, (command, name)


def test_plan_predicts_the_split_of_the_misses(tmp_path, capsys):
    write_checkpoint(tiny_config("mixtral", num_experts=8), tmp_path / "ck", seed=1)
    args = ["plan", str(tmp_path / "ck"), "--hbm", "1.75MB", "--batch-capacity", "16",
            "--miss", "auto", "--workspace", "600KiB"]
    assert main([*args, "--miss-rates", "link=50,host=40,row=0.01"]) == 0
    out = capsys.readouterr().out
    # 16 rows over 8 experts, top-2: 7.9 distinct per layer, 1 of the 16 experts in HBM
    assert "7 misses of ~4 rows; 3 on the host, 4 over the link" in out
    assert main(args) == 0
    assert "give --miss-rates" in capsys.readouterr().out


def test_plan_and_generate_share_the_engine_defaults():
    for argv in (["plan", "CKPT", "--hbm", "1GB"], ["generate", "CKPT", "--hbm", "1GB"]):
        assert engine_config(build_parser().parse_args(argv)) == EngineConfig(hbm_budget="1GB")
    args = build_parser().parse_args(["generate", "CKPT"])
    assert engine_config(args) is None
    assert resident_config(args) == EngineConfig()
    args = build_parser().parse_args(["generate", "CKPT", "--expert-devices", "2",
                                      "--max-len", "64"])
    assert engine_config(args) is None
    assert resident_config(args) == EngineConfig(expert_devices=2, max_len=64)


@pytest.mark.parametrize(("flags", "named"), [
    (["--heat", "/nonexistent.json"], "--heat"),
    (["--policy", "lru", "--staging-slots", "2"], "--policy, --staging-slots"),
    (["--record-heat", "heat.json"], "--record-heat"),
    (["--hbm", "1GB", "--heat", "/nonexistent.json"], "--heat /nonexistent.json: no such file"),
])  # fmt: skip
def test_engine_flags_without_hbm_are_refused(tmp_path, capsys, flags, named):
    argv = ["generate", str(tmp_path), "--prompt-ids", "1,2", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and err.startswith("strata generate: error:")


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"strata {__version__}\n"
    for command in ("generate", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "examples:" in text and "--max-len N KV positions per row" in text
        assert "(default: 256)" in text and "(default: lfru)" in text
    serve = build_parser().parse_args(["serve", "CKPT", "--hbm", "1GB"])
    assert serve.func.__name__ == "serve" and engine_config(serve).hbm_budget == "1GB"


def test_the_cli_runs_without_the_web_stack():
    """Every subcommand but `serve` works where fastapi is not installed (a GPU machine's
    environment): the server is imported only when it is asked for."""
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from strata_runtime.cli.main import main\n"
            "sys.exit(main(['sweep', '--help']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "SWEEP" in done.stdout or "sweep" in done.stdout


KEEP_PROGRAMS = True  # the generate tests share their compiled programs (conftest.py)


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    """A tiny checkpoint with the synthetic models' byte-level tokenizer."""
    cfg = tiny_config(vocab_size=300)
    path = tmp_path_factory.mktemp("text") / "ckpt"
    write_checkpoint(cfg, path, seed=2)
    for name, data in byte_level_files(cfg.vocab_size).items():
        (path / name).write_bytes(data)
    return path


def run_json(argv: list[str], out) -> dict:
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_generate_text_matches_the_api(text_ckpt, tmp_path, capsys):
    tok = load_tokenizer(text_ckpt)
    model = strata_jax.load(text_ckpt)
    prompts = ["Four score and", "We hold"]
    doc = run_json(["generate", str(text_ckpt), "--prompt", prompts[0], "--prompt", prompts[1],
                    "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--ignore-eos"],
                   tmp_path / "out.json")
    ids = [tok.encode(p) for p in prompts] + [[5, 6, 7]]
    want = strata_jax.generate(model, ids, 6)
    assert [r["prompt_ids"] for r in doc["requests"]] == ids
    assert [r["new_ids"] for r in doc["requests"]] == want
    shown = capsys.readouterr()
    for r in doc["requests"]:
        assert r["text"] == tok.decode(r["new_ids"]) and r["text"] in shown.out
    assert "[5, 6, 7] -> " in shown.out and "tok_s" in shown.err  # stats on stderr
    t = doc["timing"]
    assert t["warmup_s"] > 0 and not t["includes_compilation"] and t["new_tokens"] == 18
    assert t["tok_s"] == pytest.approx(18 / t["run_s"])


def test_generate_chat_and_stops(text_ckpt, tmp_path):
    tok = load_tokenizer(text_ckpt)
    base = ["generate", str(text_ckpt), "--max-new-tokens", "8", "--no-warmup", "--ignore-eos"]
    full = run_json([*base, "--chat", "--prompt", "Hi"], tmp_path / "a.json")["requests"][0]
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert full["prompt_ids"] == tok.encode(chat, add_special_tokens=False)
    new = full["new_ids"]
    by_id = run_json([*base, "--chat", "--prompt", "Hi", "--stop-id", str(new[2])],
                     tmp_path / "b.json")["requests"][0]
    assert by_id["new_ids"] == new[: new.index(new[2]) + 1] and by_id["finish"] == "stop"
    stop = full["text"][2:4]
    assert len(stop) == 2
    by_text = run_json([*base, "--chat", "--prompt", "Hi", "--stop", stop],
                       tmp_path / "c.json")["requests"][0]
    assert by_text["text"] == full["text"][: full["text"].index(stop)]
    # generation stopped at the token that completed the stop string: ids and text agree
    ends = next(n for n in range(1, len(new) + 1) if stop in tok.decode(new[:n]))
    assert by_text["new_ids"] == new[:ends] and by_text["finish"] == "stop"


def test_sampling_flags(text_ckpt, tmp_path):
    argv = ["generate", str(text_ckpt), "--prompt", "Four", "--max-new-tokens", "5",
            "--no-warmup", "--temperature", "0.9", "--top-p", "0.9", "--seed", "4"]
    doc = run_json(argv, tmp_path / "s.json")
    tok = load_tokenizer(text_ckpt)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=4, stop_ids=tok.eos_ids)
    want = strata_jax.generate(strata_jax.load(text_ckpt), [tok.encode("Four")], 5,
                               sampling=params)
    assert doc["requests"][0]["new_ids"] == want[0]
    assert doc["sampling"]["temperature"] == 0.9 and doc["sampling"]["seed"] == 4


def test_generate_through_the_engine(text_ckpt, tmp_path, capsys):
    heat = tmp_path / "heat.json"
    argv = ["generate", str(text_ckpt), "--prompt", "Four score", "--max-new-tokens", "4",
            "--ignore-eos", "--hbm", "1GiB", "--predictor", "none", "--record-heat", str(heat),
            "--workspace", "64MiB"]  # fixed: the measured workspace is test_plan_prints_...'s
    doc = run_json(argv, tmp_path / "e.json")
    want = strata_jax.generate(strata_jax.load(text_ckpt),
                               [load_tokenizer(text_ckpt).encode("Four score")], 4)
    assert doc["requests"][0]["new_ids"] == want[0] and heat.exists()
    assert doc["engine"]["decode_steps"] == 3 and doc["engine"]["compile_s"] == 0  # warmed
    assert "engine stats (the timed run):" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "named"), [
    (["--prompt-ids", "1,2", "--prompt-ids", "3,300"],
     "request 1: token id 300 is outside the vocabulary [0, 300) (the 2nd prompt flag, "
     "--prompt-ids"),
    (["--prompt-ids", ""], "argument --prompt-ids: expected at least one token id"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "0"],
     "max_new_tokens must be >= 1, got 0 (the 1st prompt flag, --prompt-ids; "
     "--max-new-tokens 0, --max-len"),
    (["--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--max-len", "8"],
     "request 0: 3 prompt + 6 new tokens exceed max_len=8 (the 1st prompt flag, --prompt-ids; "
     "--max-new-tokens 6, --max-len 8)"),
    (["--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--max-len", "8", "--hbm", "1GiB"],
     "--max-new-tokens 6, --max-len 8)"),
])  # fmt: skip
def test_bad_requests_name_the_flag_before_anything_loads(text_ckpt, capsys, flags, named):
    """(An empty text prompt is a request for text after the tokenizer's BOS: not an error.)"""
    try:
        status = main(["generate", str(text_ckpt), "--no-warmup", *flags])
    except SystemExit as e:  # argparse refuses the value itself
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and "error:" in err and named in err, err


def test_second_call_hits_the_compilation_cache(tmp_path):
    """Two fresh processes: the first writes the cache, the second adds nothing to it (every
    program loaded, none compiled) and warms up faster."""
    cfg = tiny_config(vocab_size=64, num_layers=1)
    write_checkpoint(cfg, tmp_path / "ckpt")
    cache = tmp_path / "cache"
    env = {**os.environ, CACHE_ENV: str(cache)}

    def run(name: str) -> dict:
        out = tmp_path / f"{name}.json"
        done = subprocess.run([sys.executable, "-m", "strata_runtime.cli", "generate",
                               str(tmp_path / "ckpt"), "--prompt-ids", "1,2,3",
                               "--max-new-tokens", "1", "--batch-capacity", "1", "--max-len",
                               "16", "--json", str(out)], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return json.loads(out.read_text())["timing"]

    first = run("first")
    entries = set(p.name for p in cache.iterdir())
    assert entries
    second = run("second")
    assert set(p.name for p in cache.iterdir()) - entries == set()
    assert second["warmup_s"] < first["warmup_s"], (first, second)


@pytest.mark.parametrize("command", ["generate", "bench", "plan"])
def test_the_old_host_flag_names_the_host_memory_budget(command, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "ck", "--hbm", "8GB", "--host", "64GB"])
    assert done.value.code == 2
    assert "--host 64GB: the host-memory budget is --host-mem SIZE" in capsys.readouterr().err


def test_serve_host_is_the_address_to_listen_on():
    args = build_parser().parse_args(["serve", "ck", "--host", "0.0.0.0", "--hbm", "8GB",
                                      "--host-mem", "64GB"])
    assert args.bind == "0.0.0.0" and engine_config(args).host_budget == "64GB"
    assert build_parser().parse_args(["serve", "ck"]).bind == "127.0.0.1"


def test_plan_shows_the_tier1_the_run_holds_and_the_run_warns(tmp_path, capsys, caplog):
    from strata_jax.tools.synth import synthesize

    ck = tmp_path / "tiny"
    synthesize("tiny", ck, progress=False)
    flags = ["--hbm", "4MB", "--host-mem", "100KB", "--workspace", "200KB"]
    assert main(["plan", str(ck), *flags]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tier 1:"))
    held = int(line.split("holds ")[1].split()[0])
    assert "Give --host-mem at least" in line and held > 1
    config = engine_config(build_parser().parse_args(["generate", str(ck), *flags]))
    with caplog.at_level("WARNING", logger="strata.engine"), \
            Engine.from_checkpoint(ck, config) as engine:
        assert len(engine.shares[0].residency.host_key) == held
    assert f"tier 1 holds {held} experts where the host budget gives 1" in caplog.text
    assert main(["plan", str(ck), "--hbm", "3MB", "--workspace", "200KB"]) == 2
    assert "--workspace SIZE fixes it" in capsys.readouterr().err


def test_plan_shows_the_slots_and_tier1_that_overrides_give(tmp_path, capsys):
    """--resident-experts and --host-experts replace the budget's split in the plan as in the
    run (the engine's tier sizes are the plan's)."""
    from strata_jax.tools.synth import synthesize

    ck = tmp_path / "tiny"
    synthesize("tiny", ck, progress=False)
    flags = ["--hbm", "64MB", "--workspace", "200KB", "--resident-experts", "5",
             "--host-experts", "20", "--batch-capacity", "2", "--max-len", "64"]
    assert main(["plan", str(ck), *flags]) == 0
    out = capsys.readouterr().out
    assert "expert pool (5 slots)" in out
    tiers = {int(line.split()[1]): int(line.split()[-2]) for line in out.splitlines()
             if line.startswith("  tier ")}
    assert tiers[0] == 5 and tiers[1] == 20
    config = engine_config(build_parser().parse_args(["generate", str(ck), *flags]))
    with Engine.from_checkpoint(ck, config) as engine:
        assert len(engine.shares[0].residency.host_key) == 20
