"""lm-eval's model interface on a Strata checkpoint, with no HTTP in between.

Importing this module registers the model "strata" in lm-eval's registry (lm-eval has no
plugin entry point for models), so from Python:

    import strata_runtime.serving.lm_eval  # noqa: F401  (registers "strata")
    lm_eval.simple_evaluate(model="strata", model_args="checkpoint=CKPT,hbm=8GB", tasks=[...])

and from the shell `strata eval lm --model_args checkpoint=CKPT,hbm=8GB --tasks ...` (lm-eval's
own command line, this module imported first). Without `hbm` the model runs resident
(`strata_jax`), with it on the offload engine; every other `EngineConfig` field is a model
argument under its own name (`host_mem` is the host-memory budget). Log-likelihoods come from
`scoring.loglikelihood` and generations from the scheduler with lm-eval's stop strings, so the
answers are those of `strata_jax.score` / `generate` with the same shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval imports its own models only into an empty registry)
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

import strata_jax
from strata_jax.batching.resident import ResidentEngine
from strata_jax.batching.scheduler import Scheduler
from strata_jax.batching.scoring import loglikelihood
from strata_jax.batching.text import cut_at_stop
from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.formats.tokenizer import load_tokenizer
from strata_jax.step.sampling import SamplingParams
from strata_runtime.engine.config import EngineConfig, context_max_len
from strata_runtime.engine.offload import Engine

RENAMED = {"hbm": "hbm_budget", "host_mem": "host_budget"}
"""Model arguments named as the command-line flags rather than as `EngineConfig` fields."""
LM_EVAL_ONLY = ("batch_size", "max_batch_size", "device")
"""Arguments lm-eval passes every model: the batch is the engine's continuous batch."""


@register_model("strata")
class StrataLM(TemplateLM):
    """A Strata checkpoint as an lm-eval model (`loglikelihood`, `loglikelihood_rolling`,
    `generate_until`)."""

    def __init__(self, checkpoint: str, max_gen_toks: int = 256, **kwargs: Any) -> None:
        super().__init__()
        for name in LM_EVAL_ONLY:
            kwargs.pop(name, None)
        knobs = {RENAMED.get(k, k): v for k, v in kwargs.items()}
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(knobs) - fields)
        if unknown:
            raise ValueError(f"strata model_args: unknown {', '.join(unknown)} (give checkpoint, "
                             "max_gen_toks, hbm, host_mem or an EngineConfig field)")
        config, reader = EngineConfig(**knobs), CheckpointReader(checkpoint)
        if "max_len" not in knobs:  # the model's context, within the budget
            config, _ = context_max_len(config, reader)
        self.tokenizer = load_tokenizer(checkpoint)
        self.max_gen_toks = int(max_gen_toks)
        self.max_len = config.max_len
        if config.hbm_budget is None:
            engine = ResidentEngine(strata_jax.load(checkpoint), config.batch_capacity,
                                    config.max_len, config.prefill_chunk, config.prefill_rows)
        else:
            engine = Engine(reader, config)
        self.engine = engine

    def _scheduler(self) -> Scheduler:
        return Scheduler(self.engine, self.tokenizer)

    # --- tokens ---------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.special_tokens.get("eos_token")
        token = None if eos is None else self.tokenizer.id_of(eos)
        if token is None:
            if not self.tokenizer.eos_ids:
                raise ValueError(f"{self.tokenizer.source}: the tokenizer has no eos token")
            token = min(self.tokenizer.eos_ids)
        return token

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_id
        return self.eot_token_id if bos is None else bos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    # --- lm-eval's requests ---------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        pairs = [self._fit(context, continuation) for _, context, continuation in requests]
        out = []
        for (key, _, _), like in zip(requests, loglikelihood(self._scheduler(), pairs),
                                     strict=True):
            answer = (like.logprob, like.greedy)
            self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def _fit(self, context: Sequence[int], continuation: Sequence[int]
             ) -> tuple[list[int], list[int]]:
        """The pair cut from the left to leave a row room for one drawn token."""
        room = self.max_len - 1
        if len(continuation) >= room:
            raise ValueError(f"a continuation of {len(continuation)} tokens does not fit "
                             f"max_len={self.max_len} with its context: raise max_len")
        whole = (list(context) + list(continuation))[-room:]
        return whole[: len(whole) - len(continuation)], list(continuation)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            for pair in lm_utils.get_rolling_token_windows(
                    tokens, self.prefix_token_id, self.max_len - 1, 1):
                windows.append(lm_utils.make_disjoint_window(pair))
                owner.append(i)
        scores = loglikelihood(self._scheduler(), windows) if windows else []
        totals = [0.0] * len(requests)
        for i, like in zip(owner, scores, strict=True):
            totals[i] += like.logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        sched = self._scheduler()
        runs = []
        for context, gen_kwargs in (req.args for req in requests):
            sampling, new = self._sampling(dict(gen_kwargs))
            ids = self.tok_encode(context)[-(self.max_len - new):]
            runs.append((sched.submit(ids, new, sampling), sampling.stop))
        sched.run()
        out = []
        for req, (r, stops) in zip(requests, runs, strict=True):
            context, gen_kwargs = req.args
            if r.error is not None:
                raise RuntimeError(f"request {r.id}: {r.error}")
            text = cut_at_stop(self.tokenizer.decode(r.tokens), stops)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def _sampling(self, gen_kwargs: dict[str, Any]) -> tuple[SamplingParams, int]:
        """lm-eval's generation settings as sampling params and a token limit."""
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        new = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
        sample = bool(gen_kwargs.pop("do_sample", False))
        temperature = float(gen_kwargs.pop("temperature", 0.0)) if sample else 0.0
        top_p = float(gen_kwargs.pop("top_p", 1.0) or 1.0)
        if new >= self.max_len:
            raise ValueError(f"max_gen_toks={new} does not fit max_len={self.max_len}")
        return SamplingParams(temperature=temperature, top_p=top_p if sample else 1.0,
                              seed=int(gen_kwargs.pop("seed", 0) or 0),
                              stop_ids=self.tokenizer.eos_ids,
                              stop=tuple(s for s in until if s)), new
