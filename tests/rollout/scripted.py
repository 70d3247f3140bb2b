"""A scripted engine for unit tests of the rollout state machine: it 'generates' given texts, obeying stops."""
from __future__ import annotations

from megatron_searchr1.rollout.engine import Generation, SamplingParams


class ScriptedEngine:
    """For the prompt whose ids start a request, emit that prompt's next scripted turn text as the tokenizer's ids.

    Honours stop strings (cut right after the token that completes one: whatever the script has after it is
    what a real engine would have wasted), stop token ids and max_tokens, like the real engines. Log-probs are
    -0.1 * (position + 1) so tests can check the engine's values are the ones kept.
    """

    def __init__(self, tokenizer, scripts: dict[tuple, list[str]]):
        self.tok = tokenizer
        self.scripts = {tuple(k): list(v) for k, v in scripts.items()}
        self.calls: list[int] = []  # prompts per generate call
        self.cursor: dict[tuple, int] = {k: 0 for k in self.scripts}

    def _script_for(self, ids: list[int]) -> tuple:
        for key in self.scripts:
            if tuple(ids[: len(key)]) == key:
                return key
        raise KeyError("no script for this prompt")

    def generate(self, prompts, params: SamplingParams) -> list[Generation]:
        self.calls.append(len(prompts))
        outs = []
        for ids in prompts:
            key = self._script_for(ids)
            turn = self.cursor[key]
            self.cursor[key] += 1
            text = self.scripts[key][min(turn, len(self.scripts[key]) - 1)]
            full = self.tok.encode(text, add_special_tokens=False)
            out, reason, stop = [], "length", None
            for tid in full:
                if len(out) == params.max_tokens:
                    break
                out.append(tid)
                if tid in params.stop_token_ids:
                    reason, stop = "stop", tid
                    break
                hit = [s for s in params.stop if s in self.tok.decode(out)]
                if hit:
                    reason, stop = "stop", hit[0]
                    break
            else:
                reason = "stop" if len(out) < params.max_tokens else "length"
            outs.append(Generation(token_ids=out, logprobs=[-0.1 * (i + 1) for i in range(len(out))],
                                   finish_reason=reason, stop_reason=stop))
        return outs

    def load_weights(self, weights):
        pass

    def finish_weight_sync(self):
        pass

    def sleep(self, level=1):
        return False

    def wake_up(self, tags=None):
        pass


class SessionScriptedEngine(ScriptedEngine):
    """A ScriptedEngine that keeps sessions (the interface's `sessions=` / `end_sessions`) and records them: per
    call the keys it got, and which it was asked to end; a key must name one trajectory and only ever grow."""

    keeps_sessions = True

    def __init__(self, tokenizer, scripts):
        super().__init__(tokenizer, scripts)
        self.held: dict = {}       # key -> the last prompt + generation it saw
        self.keys: list[list] = []
        self.ended: list = []

    def generate(self, prompts, params, sessions=None):
        assert sessions is not None and len(sessions) == len(prompts)
        outs = super().generate(prompts, params)
        self.keys.append(list(sessions))
        for key, p, g in zip(sessions, prompts, outs):
            if key in self.held:  # the loop continues a session only with a longer context of the same sample
                assert p[:len(self.held[key])] == self.held[key]
            self.held[key] = list(p) + g.token_ids
        return outs

    def end_sessions(self, keys=None):
        keys = list(self.held) if keys is None else [k for k in keys if k in self.held]
        for k in keys:
            del self.held[k]
            self.ended.append(k)
