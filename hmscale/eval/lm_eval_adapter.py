"""lm-evaluation-harness adapter: any hmscale model (teacher, Hedgehog, HedgeMamba) as an `lm_eval` LM.

    hmscale eval RUN_DIR/config.yaml --tasks hellaswag,lambada_openai
    lm_eval --model hmscale --model_args pretrained=runs/demo/stage2/hf --tasks ...   (after `import hmscale.eval.lm_eval_adapter`)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm


@register_model("hmscale")
class HmscaleLM(LM):
    def __init__(self, model=None, tokenizer=None, pretrained: str | None = None, batch_size: int = 8,
                 max_length: int = 1024, device: str = "cpu", **_):
        super().__init__()
        if model is None:
            if pretrained is None:
                raise ValueError("HmscaleLM needs a model object or pretrained=DIR")
            from transformers import AutoModelForCausalLM, AutoTokenizer

            import hmscale.models  # noqa: F401  (registers HedgeMamba with the Auto classes)

            model = AutoModelForCausalLM.from_pretrained(pretrained, trust_remote_code=True)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(pretrained)
        if tokenizer is None:
            raise ValueError("HmscaleLM needs the tokenizer the model was trained with")
        self.model = model.to(device).eval()
        self.tok = tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        self._device = torch.device(device)

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
        return tqdm(requests, desc=f"[lm-eval] {type(self).__name__}", disable=disable_tqdm or len(requests) < 2,
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
        logp = F.log_softmax(self.model(input_ids=inp, return_dict=True).logits[0].float(), dim=-1)[-n:]
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

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False):
        out = []
        for req in self._progress(requests, disable_tqdm):
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 64))
            ids = torch.tensor([self._encode(context)[-self.max_length:] or [self.tok.eos_token_id]], device=self._device)
            # the stop strings end the generation (else every request ran its max_gen_toks); the text is cut below
            stopping = {"stop_strings": until, "tokenizer": self.tok} if until else {}
            gen = self.model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=False,
                                      pad_token_id=self.tok.eos_token_id, **stopping)
            text = self.tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


def unknown_tasks(tasks: list[str], include_path: str | None = None) -> list[str]:
    """The names in ``tasks`` that lm-eval-harness knows neither as a task, a group nor a tag (with the custom task
    YAMLs of ``include_path``): checked before the perplexities, which take minutes."""
    from lm_eval.tasks import TaskManager

    known = set(TaskManager(include_path=include_path).all_tasks)
    return [t for t in tasks if t not in known]


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
