"""lm-evaluation-harness adapter: any hmscale model (teacher, Hedgehog, HedgeMamba) as an `lm_eval` LM.

    hmscale eval RUN_DIR/config.yaml --tasks hellaswag,lambada_openai
    lm_eval --model hmscale --model_args pretrained=runs/demo/model --tasks ...   (after `import hmscale.eval.lm_eval_adapter`)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lm_eval.models  # noqa: F401  (before register_model below: see the note there)
import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from hmscale.hf_load import from_pretrained


def _lm_device(device) -> torch.device:
    """The device to score on; lm_eval's CLI passes ``cuda:0`` unless told otherwise (``--device``), so without a GPU
    this falls back to the CPU with a warning, as lm-eval's own ``hf`` model does."""
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError:
        raise ValueError(f"HmscaleLM: device={device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"[lm-eval] HmscaleLM: device {device!r}, but this torch sees no GPU; scoring on the CPU "
              "(pass --device cpu to silence this)", file=sys.stderr)
        return torch.device("cpu")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _lm_dtype(dtype) -> torch.dtype | None:
    """``dtype=`` of ``--model_args`` (``auto``/None: the weights' own)."""
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return None if dtype == "auto" else dtype
    if str(dtype) not in _DTYPES:
        raise ValueError(f"HmscaleLM: dtype={dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[str(dtype)]


def _positive_int(value) -> int | None:
    """``value`` as an int if it is one >= 1 (lm-eval's --model_args pass strings), else None."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if n >= 1 and n == float(value) else None


# lm-eval fills its model registry with its own models (hf, vllm, ...) on first use only if the registry is still
# empty: registering "hmscale" first left every other name unknown ("no model for this name found! Supported model
# names: hmscale") for the rest of the process. Importing lm_eval.models (lazy placeholders, cheap) registers them.
@register_model("hmscale")
class HmscaleLM(LM):
    max_gen_toks = 256  # new tokens of a generate_until task that sets no max_gen_toks: lm-eval's hf model's default

    def __init__(self, model=None, tokenizer=None, pretrained: str | None = None, batch_size: int | str = 8,
                 max_length: int = 1024, device: str | None = None, dtype: str | torch.dtype | None = None, **_):
        super().__init__()
        if device is None and model is not None:  # a model object is scored where it is (as lm-eval's hf model does)
            device = next(model.parameters()).device  # (a "cpu" default moved a GPU model, in place, to the CPU)
        device = _lm_device(device)
        dtype = _lm_dtype(dtype)
        if isinstance(tokenizer, (str, Path)):  # (--model_args tokenizer=DIR_OR_ID, as lm-eval's hf model takes it)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(str(tokenizer)))
        if model is None:
            if pretrained is None:
                raise ValueError("HmscaleLM needs a model object or pretrained=DIR")
            d = Path(str(pretrained)).expanduser()
            local = d.exists() or d.is_absolute() or str(pretrained).startswith((".", "~")) or len(d.parts) > 2
            if local and not (d / "config.json").is_file():  # (else a hub id: transformers says what is wrong)
                raise ValueError(f"HmscaleLM: pretrained={pretrained!r} holds no saved model (config.json); pass a "
                                 "run's model/ directory, e.g. runs/demo/model")
            if local and tokenizer is None and not any((d / f).is_file() for f in ("tokenizer.json",
                                                                                   "tokenizer_config.json")):
                raise ValueError(f"HmscaleLM: pretrained={pretrained!r} has no tokenizer; pass the run's model/ "
                                 "directory (the model with its tokenizer), e.g. runs/demo/model")
            from transformers import AutoModelForCausalLM, AutoTokenizer

            import hmscale.models  # noqa: F401  (registers HedgeMamba with the Auto classes)

            pretrained = str(d) if local else pretrained
            model = from_pretrained(AutoModelForCausalLM, pretrained, trust_remote_code=True)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(pretrained)
        if tokenizer is None:
            raise ValueError("HmscaleLM needs the tokenizer the model was trained with")
        self.model = model.to(device=device, dtype=dtype).eval()
        self.tok = tokenizer
        # requests are scored one at a time (the batch size is lm-eval's bookkeeping); lm_eval's --batch_size auto
        # (or auto:N) passes a string
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            batch_size = 1
        try:
            self.batch_size = int(batch_size)
        except (TypeError, ValueError):
            raise ValueError(f"HmscaleLM: batch_size={batch_size!r}; use a number or auto") from None
        self.max_length = _positive_int(max_length)
        if self.max_length is None:  # (0 or less: rolling windows of no tokens, every document scored 0.0)
            raise ValueError(f"HmscaleLM: max_length={max_length!r}; use the tokens a forward may take, 1 or more "
                             "(e.g. 1024)")
        self._device = device

    # ---------------------------------------------------------------- helpers
    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation tokens as lm-eval-harness's own models split them (``TemplateLM._encode_pair``):
        the context's trailing whitespace moves to the continuation and the pair is tokenised whole, so a
        continuation is scored on the tokens it has in running text (``"Answer: " + "A"`` scores the token ``" A"``,
        not ``" "`` then ``"A"``); an empty context is the end-of-text token."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        if not context:
            return [self.tok.eos_token_id], self._encode(continuation)
        whole, ctx = self._encode(context + continuation), self._encode(context)
        return ctx, whole[len(ctx):]

    def _progress(self, requests, disable_tqdm: bool):
        quiet = os.environ.get("HMSCALE_NO_PROGRESS") == "1"  # (batch logs, as the training bars)
        return tqdm(requests, desc=f"[lm-eval] {type(self).__name__}", disable=disable_tqdm or quiet or len(requests) < 2,
                    mininterval=5.0)

    @torch.no_grad()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) and whether it is the greedy continuation."""
        n = len(continuation)
        if n == 0:
            return 0.0, True
        if n > self.max_length:
            raise ValueError(f"lm-eval: a continuation of {n} tokens does not fit max_length={self.max_length}; "
                             "raise max_length")
        ids = (context + continuation)[-(self.max_length + 1):]
        inp = torch.tensor([ids[:-1]], device=self._device)
        # (the continuation's positions only: a long context's (L, vocab) fp32 log-softmax is large and unused)
        logp = F.log_softmax(self.model(input_ids=inp, return_dict=True).logits[0, -n:].float(), dim=-1)
        target = torch.tensor(ids[-n:], device=self._device)
        total = logp.gather(-1, target[:, None]).sum().item()
        greedy = bool((logp.argmax(-1) == target).all().item())
        return total, greedy

    # ---------------------------------------------------------------- LM API
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        out = []
        for req in self._progress(requests, disable_tqdm):
            out.append(self._score(*self._encode_pair(*req.args)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for req in self._progress(requests, disable_tqdm):
            ids = [self.tok.eos_token_id] + self._encode(req.args[0])
            total, step = 0.0, self.max_length
            for start in range(1, len(ids), step):
                ctx = ids[max(0, start - self.max_length): start]
                total += self._score(ctx, ids[start: start + step])[0]
            out.append(total)
        return out

    def _gen_settings(self, kwargs: dict) -> tuple[list[str], int, bool, dict]:
        """A request's generation settings read as lm-eval-harness's own models read them: the stop strings (empty
        ones skipped), the new-token limit (``max_gen_toks``, else its aliases ``max_new_tokens``, ``max_tokens``,
        ``max_completion_tokens``, else 256), and sampling: ``do_sample`` as given (greedy all the same at a
        temperature of 0), or, when the task leaves it out, on exactly when it gives a temperature above 0; sampling
        takes the task's temperature / top_p / top_k (transformers' defaults for those it leaves out)."""
        until = kwargs.get("until") or []
        until = [s for s in ([until] if isinstance(until, str) else until) if s]  # ("" stops nothing: skipped)
        limits = [kwargs.get(k) for k in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")]
        max_new = int(next((v for v in limits if v is not None), self.max_gen_toks))
        sampling = {k: kwargs[k] for k in ("temperature", "top_p", "top_k") if kwargs.get(k) is not None}
        temperature = sampling.get("temperature")
        hot = temperature is None or float(temperature) > 0
        do_sample = kwargs.get("do_sample")
        do_sample = temperature is not None and hot if do_sample is None else bool(do_sample) and hot
        return until, max_new, do_sample, sampling

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False):
        if requests and not callable(getattr(self.model, "generate", None)):
            # (the stage-1 Hedgehog student is a plain module: it scores tokens, it has no generate())
            raise ValueError(f"lm-eval: {type(self.model).__name__} has no generate(), so generate_until tasks cannot "
                             "run on it; score it on loglikelihood tasks, or generate with the teacher or HedgeMamba")
        out = []
        for req in self._progress(requests, disable_tqdm):
            context, kwargs = req.args
            until, max_new, do_sample, sampling = self._gen_settings(kwargs)
            ids = torch.tensor([self._encode(context)[-self.max_length:] or [self.tok.eos_token_id]], device=self._device)
            # the stop strings end the generation (else every request ran its max_gen_toks); the text is cut below.
            # Checked on the decoded continuation, as lm-eval's own models do: transformers' stop_strings reads the
            # tokenizer's vocabulary through its decoder, and failed inside for one without (a word-level tokenizer)
            stopping = {"stopping_criteria": _stop_at_text(self.tok, until, ids.shape[1])} if until else {}
            gen = self.model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=do_sample,
                                      pad_token_id=self.tok.eos_token_id, **(sampling if do_sample else {}),
                                      **stopping)
            text = self.tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


def _stop_at_text(tokenizer, stops: list[str], start: int):
    """A stopping criterion: generation ends once the text decoded from position ``start`` on holds a stop string."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAtText(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            texts = [tokenizer.decode(row[start:], skip_special_tokens=True) for row in input_ids]
            done = [any(s in text for s in stops) for text in texts]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([StopAtText()])


def unknown_tasks(tasks: list[str], include_path: str | None = None) -> list[str]:
    """The names in ``tasks`` that lm-eval-harness knows neither as a task, a group nor a tag (with the custom task
    YAMLs of ``include_path``): checked before the perplexities, which take minutes.

    lm-eval's index parses every task YAML it has (~14,000, with their includes: ~10-20 s); a name is only ever
    registered from text in one of those files, so a name that no YAML under the searched folders spells out is
    unknown without that parse (a mistyped task fails in well under a second), and the index is built only for
    the names that some file mentions."""
    if not _mentioned_in_task_yamls(tasks, include_path):
        return list(tasks)
    from lm_eval.tasks import TaskManager

    known = set(TaskManager(include_path=include_path).all_tasks)
    return [t for t in tasks if t not in known]


def _mentioned_in_task_yamls(names: list[str], include_path: str | None = None) -> set[str]:
    """The names in ``names`` that occur, as text, in some YAML file (.yaml, or a template such as _template_yaml)
    under lm-eval's own task folder or ``include_path`` (the folders TaskManager indexes; its cache and checkpoint
    folders skipped as it skips them)."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("lm_eval")  # its folder, without importing it (seconds: torch, datasets, ...)
    roots = [os.path.join(p, "tasks") for p in spec.submodule_search_locations]
    builtin = len(roots)
    if include_path:
        roots += [str(p) for p in (include_path if isinstance(include_path, (list, tuple)) else [include_path])]
    wanted = {n: n.encode() for n in names}
    found: set[str] = set()
    for r, root in enumerate(roots):
        for folder, subdirs, files in os.walk(root):
            subdirs[:] = [d for d in subdirs if d not in ("__pycache__", ".ipynb_checkpoints")]
            for f in files:
                if not f.endswith("yaml"):  # (.yaml, and the templates they include: _template_yaml)
                    continue
                try:
                    with open(os.path.join(folder, f), "rb") as fh:
                        text = fh.read()
                except OSError:
                    continue
                if r >= builtin and b"include" in text:  # a custom YAML's name may come from a file anywhere
                    return set(names)  # (then the full index decides)
                found.update(n for n, b in wanted.items() if n not in found and b in text)
                if len(found) == len(wanted):
                    return found
    return found


def evaluate_tasks(model, tokenizer, tasks: list[str], include_path: str | None = None, limit: int | None = None,
                   batch_size: int = 8) -> dict:
    """Run lm-eval-harness tasks on a model object; returns {task: {metric: value}}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    lm = HmscaleLM(model=model, tokenizer=tokenizer, batch_size=batch_size,
                   device=str(next(model.parameters()).device))
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_path=include_path),
                                  limit=limit, log_samples=False)
    return {t: {k: v for k, v in m.items() if isinstance(v, (int, float))} for t, m in res["results"].items()}
