"""lm-eval on a Strata checkpoint: natively (`--model strata`, resident and offloaded) and
through `strata serve` (`local-completions`), on two local-data tasks (multiple choice and
generate_until). The native scores equal a direct float64 computation from
`strata_jax.logits`, the offloaded and the served runs the native one."""

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

import strata_jax  # noqa: E402
import strata_runtime.serving.lm_eval  # noqa: E402, F401  (registers "strata")
from strata_jax.batching.text import cut_at_stop  # noqa: E402
from strata_jax.step.sampling import SamplingParams  # noqa: E402
from strata_jax.tools.synth import synthesize  # noqa: E402
from strata_runtime.serving.lm_eval import StrataLM  # noqa: E402
from tests.runtime.served import start_server  # noqa: E402

SHAPE = "batch_capacity=4,max_len=128"
QUESTIONS = [("The cat sat on the", ["mat", "sky", "moon"], 0),
             ("One, two,", ["three", "blue", "ten"], 0),
             ("Water is", ["wet", "dry", "loud"], 1),
             ("abc", ["def", "xyz", "abd"], 2)]
GEN = [("Count: 1 2 3", "4"), ("Say hi:", "hi"), ("a b c", "d")]
MC_YAML = """task: strata_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_YAML = """task: strata_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmeval")
    ckpt = root / "tiny"
    synthesize("tiny", ckpt, progress=False)  # with its byte-level tokenizer
    tasks = root / "tasks"
    tasks.mkdir()
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    gen = [{"prompt": p, "target": t} for p, t in GEN]
    for name, rows, yaml in (("mc", mc, MC_YAML), ("gen", gen, GEN_YAML)):
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(yaml.format(data=data))
    os.environ["HF_HOME"] = str(root / "hf")
    return ckpt, TaskManager(include_path=str(tasks)), tasks


def _evaluate(model: str, model_args: str, manager) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args,
                                   tasks=["strata_mc", "strata_gen"], task_manager=manager,
                                   log_samples=True, random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0)


def _loglikelihoods(out: dict) -> list[float]:
    return [float(r[0][0]) for s in out["samples"]["strata_mc"] for r in s["resps"]]


def _generations(out: dict) -> list[str]:
    return [s["resps"][0][0] for s in out["samples"]["strata_gen"]]


def _reference(ckpt: Path) -> tuple[list[float], float, list[str]]:
    """Per choice log-likelihoods and accuracy in float64 from the full forward, and the
    greedy generations of `strata_jax.generate` cut at the task's stop strings."""
    model = strata_jax.load(ckpt)
    lm = StrataLM(str(ckpt), batch_capacity=4, max_len=128)
    pairs = [lm._encode_pair(question, " " + choice)
             for question, choices, _ in QUESTIONS for choice in choices]
    # every sequence in one causal forward, padded to one length (one program, not one per
    # length): a position's logits do not depend on the tokens after it
    width = max(len(c) + len(t) for c, t in pairs)
    tokens = np.array([c + t + [0] * (width - len(c) - len(t)) for c, t in pairs], np.int32)
    logits = strata_jax.logits(model, tokens).astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    lls = []
    for row, (context, continuation) in enumerate(pairs):
        at = np.arange(len(context) - 1, len(context) - 1 + len(continuation))
        lls.append(float(logp[row, at, continuation].sum()))
    right, first = 0, 0
    for _, choices, answer in QUESTIONS:
        right += int(np.argmax(lls[first:first + len(choices)]) == answer)
        first += len(choices)
    # the generations in one batch: a request's tokens do not depend on its batch
    # (tests/step/test_step.py::test_generate_is_batch_invariant)
    tok = model.tokenizer
    ids = [tok.encode(prompt, add_special_tokens=False) for prompt, _ in GEN]
    params = SamplingParams(stop=("\n", "."), stop_ids=tok.eos_ids)
    new = strata_jax.generate(model, ids, 6, sampling=params, batch_capacity=4, max_len=128)
    texts = [cut_at_stop(tok.decode(n), ("\n", ".")) for n in new]
    return lls, right / len(QUESTIONS), texts


def test_native_resident_and_offloaded_and_served_agree(setup, tmp_path):
    ckpt, manager, _ = setup
    lls, acc, texts = _reference(ckpt)
    native = _evaluate("strata", f"checkpoint={ckpt},{SHAPE}", manager)
    assert native["results"]["strata_mc"]["acc,none"] == pytest.approx(acc)
    np.testing.assert_allclose(_loglikelihoods(native), lls, rtol=1e-4, atol=1e-4)
    assert _generations(native) == texts
    # a fixed workspace: the ledger's own measurement (abstract compiles of the step programs)
    # is tests/runtime/residency/test_workspace.py's
    offloaded = _evaluate("strata", f"checkpoint={ckpt},{SHAPE},hbm=1GiB,workspace=64MiB,"
                          "resident_experts=3", manager)
    assert _loglikelihoods(offloaded) == _loglikelihoods(native)
    assert _generations(offloaded) == texts
    with _server(ckpt, tmp_path) as base:
        served = _evaluate("local-completions", f"model=tiny,base_url={base}/v1/completions,"
                           f"tokenizer={ckpt},tokenizer_backend=huggingface,max_length=128,"
                           "num_concurrent=2,max_retries=1", manager)
    np.testing.assert_allclose(_loglikelihoods(served), _loglikelihoods(native), rtol=1e-5)
    assert served["results"]["strata_mc"]["acc,none"] == native["results"]["strata_mc"][
        "acc,none"]


@contextlib.contextmanager
def _server(ckpt: Path, tmp: Path):
    """`strata serve` of `ckpt` with the native runs' shape, for the block's length."""
    with open(tmp / "server.log", "w+") as log:
        proc, base = start_server(ckpt, ["--batch-capacity", "4", "--max-len", "128",
                                         "--served-model-name", "tiny"], log)
        try:
            yield base
        finally:
            proc.terminate()
            proc.wait(30)
