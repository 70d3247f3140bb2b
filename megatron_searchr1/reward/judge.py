"""An LLM judge as a reward: a judge model behind an OpenAI-compatible endpoint says whether a prediction answers the
question as the gold answers do.

    judge = Judge("http://127.0.0.1:8001", model="judge")          # e.g. vLLM's own OpenAI server
    scores = judge.score([("Who founded Acme?", ["Bo Lund"], "Bo Lund"), ...])   # [1.0, ...]

    python -m vllm.entrypoints.openai.api_server --model /models/Qwen2.5-7B-Instruct --served-model-name judge \
        --port 8001

What it promises:
- One chat-completion request per distinct (question, gold, prediction), all of a batch's in flight at once (up to
  `concurrency`), temperature 0, the verdict constrained to `yes` / `no` where the server supports vLLM's
  `structured_outputs` (`guided=True`; an OpenAI endpoint without it: `guided=False`, the reply's first word read).
- A cache: a pair asked once is never asked again in this process (GRPO's n samples of a prompt often agree).
- A prediction that is missing (the policy never answered) scores 0 without asking: that is the policy's failure.
- Never a silent 0 for the judge's failure: a request that times out, an HTTP error or a reply that is neither yes
  nor no is retried `max_retries` times; a pair that still has no verdict raises `JudgeDown`, which stops a run as a
  dead retriever does (the entry points' exit code 3, the trainer's checkpoint-and-stop path), naming the judge
  and the last error.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from megatron_searchr1.search.client import RetrievalDown

JUDGE_PROMPT = (
    "You are grading the answer to a question against its gold answers.\n"
    "Question: {question}\n"
    "Gold answers: {gold}\n"
    "Predicted answer: {prediction}\n"
    "Does the predicted answer mean the same as one of the gold answers? Reply with one word: yes or no."
)
VERDICTS = {"yes": 1.0, "no": 0.0}


class JudgeDown(RetrievalDown):
    """The judge gave no verdict for a pair after every retry: the run stops (exit code 3) instead of scoring 0."""

    def __init__(self, url: str, failed: int, asked: int, last_error: str):
        self.url, self.failed, self.searched, self.last_error = url, failed, asked, last_error
        Exception.__init__(self, f"the judge at {url} gave no verdict for {failed} of {asked} answers (last error: "
                                 f"{last_error}); bring the judge back and resume the run "
                                 "(a reward is never scored 0 for the judge's failure)")


def judge_prompt(question: str, gold: Sequence[str], prediction: str, template: str = JUDGE_PROMPT) -> str:
    """The judge's prompt for one answer.

    >>> print(judge_prompt("Who founded Acme?", ["Bo Lund", "B. Lund"], "Bo Lund").splitlines()[2])
    Gold answers: Bo Lund | B. Lund
    """
    return template.format(question=question, gold=" | ".join(gold), prediction=prediction)


def read_verdict(text: str) -> Optional[float]:
    """1.0 / 0.0 for a reply that starts with yes / no (any case, punctuation after it), else None.

    >>> read_verdict(" Yes."), read_verdict("no"), read_verdict("maybe")
    (1.0, 0.0, None)
    """
    word = text.strip().lower()
    for verdict, score in VERDICTS.items():
        if word.startswith(verdict) and (len(word) == len(verdict) or not word[len(verdict)].isalpha()):
            return score
    return None


_JUDGES: dict = {}


def judge_for(algo) -> "Judge":
    """The process's Judge for config.algo's judge settings (one per settings: its cache lives as long as the run)."""
    template = JUDGE_PROMPT
    if algo.judge_prompt:
        with open(algo.judge_prompt, encoding="utf-8") as f:
            template = f.read()
    key = (algo.judge_url, algo.judge_model, template, algo.judge_timeout, algo.judge_max_retries, algo.judge_guided)
    if key not in _JUDGES:
        _JUDGES[key] = Judge(algo.judge_url, algo.judge_model, template, timeout=algo.judge_timeout,
                             max_retries=algo.judge_max_retries, guided=algo.judge_guided)
    return _JUDGES[key]


class Judge:
    """The judge client (module doc). Thread-safe; keep one per process: the cache lives in it."""

    def __init__(self, url: str, model: str, template: str = JUDGE_PROMPT, timeout: float = 60.0,
                 max_retries: int = 2, concurrency: int = 16, guided: bool = True, max_tokens: int = 4,
                 backoff: float = 0.5):
        import httpx

        if "{prediction}" not in template or "{question}" not in template or "{gold}" not in template:
            raise ValueError("the judge's prompt template needs {question}, {gold} and {prediction}")
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.model, self.template, self.timeout = model, template, timeout
        self.max_retries, self.concurrency, self.guided = max_retries, concurrency, guided
        self.max_tokens, self.backoff = max_tokens, backoff
        self.cache: dict[tuple, float] = {}
        self.stats = {"asked": 0, "cached": 0, "requests": 0, "retries": 0}
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=concurrency))
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="judge")

    def score(self, items: Sequence[tuple[str, Sequence[str], Optional[str]]]) -> list[float]:
        """One score in {0, 1} per (question, gold answers, prediction); raises JudgeDown (module doc)."""
        keys = [(q, tuple(g), p.strip() if p else "") for q, g, p in items]
        todo = sorted({k for k in keys if k[2] and k not in self.cache})
        with self._lock:
            self.stats["asked"] += len(todo)
            self.stats["cached"] += sum(1 for k in keys if k[2]) - len(todo)  # known, or asked once for the batch
        outcomes = list(self._pool.map(self._ask, todo))
        failed = [err for _, err in outcomes if err is not None]
        if failed:
            raise JudgeDown(self.url, len(failed), len(todo), failed[-1])
        for k, (verdict, _) in zip(todo, outcomes):
            self.cache[k] = verdict
        return [self.cache[k] if k[2] else 0.0 for k in keys]

    def _ask(self, key: tuple) -> tuple[Optional[float], Optional[str]]:
        question, gold, prediction = key
        body = {"model": self.model, "temperature": 0.0, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": judge_prompt(question, gold, prediction, self.template)}]}
        if self.guided:
            body["structured_outputs"] = {"choice": list(VERDICTS)}
        error = "no attempt"
        for attempt in range(self.max_retries + 1):
            if attempt:
                with self._lock:
                    self.stats["retries"] += 1
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                with self._lock:
                    self.stats["requests"] += 1
                r = self._http.post(f"{self.url}/v1/chat/completions", json=body)
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}: {r.text[:200]}"
                    continue
                reply = r.json()["choices"][0]["message"]["content"] or ""
            except Exception as e:  # noqa: BLE001 - timeouts, refused connections, malformed bodies: all retried
                error = f"{type(e).__name__}: {e}"
                continue
            verdict = read_verdict(reply)
            if verdict is not None:
                return verdict, None
            error = f"the reply {reply[:80]!r} is neither yes nor no"
        return None, error

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._http.close()
