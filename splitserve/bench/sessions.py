"""A multi-turn chat workload on the Azure conversation trace's arrivals and lengths.

The Azure LLM inference trace (conversation service, one hour) gives each request's arrival time,
context tokens and generated tokens, but not which requests belong to one conversation. This
module makes conversations out of it, keeping every request's arrival and lengths exactly: going
through the requests in arrival order, each one either continues an open conversation or starts a
new one, and a conversation's context grows turn by turn:

    turn 1:   system prompt (a prefix of one of a few shared ones) + user message
    turn k:   turn k-1's prompt + turn k-1's reply + a new user message

so turn k shares turn k-1's whole prompt as its prefix (the reply's tokens are the client's copy
of the answer: the mock engine generates other tokens, so only the prompt part is reusable, as
with real engines whose chat template re-renders the reply). Request i continues an open
conversation (chosen uniformly among those that fit) with probability ``1 - new_session_prob``
when one fits: its context must hold the last prompt, the reply and at least ``min_user_tokens``;
its user must have read the reply (``reading tokens/s``) and thought (``think_s``) since the last
turn; and the conversation must have been idle less than ``max_idle_s``. All these times are the
trace's (the real world's); ``speedup`` then compresses arrivals only. Requests carry their
conversation as ``cache_key`` (sent as OpenAI's ``prompt_cache_key``).

System prompts: ``num_system_prompts`` fixed token sequences, picked with Zipf(1) weights (one is
hot), of which a first turn uses its first ``min(system_prompt_tokens, context // 2)`` tokens.

Everything is a pure function of the trace and the seed. It knows nothing of servers or routers.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from splitserve.bench.clients import RequestSpec
from splitserve.bench.workloads import BenchInputError, random_prompt


@dataclass(frozen=True, slots=True)
class SessionsConfig:
    new_session_prob: float = 0.35
    num_system_prompts: int = 16
    system_prompt_tokens: int = 512
    min_user_tokens: int = 16
    reading_tokens_per_s: float = 20.0
    think_s: float = 2.0
    max_idle_s: float = 1800.0


@dataclass(frozen=True, slots=True)
class AzureRow:
    arrival_s: float            # since the trace's first request
    context_tokens: int
    generated_tokens: int


# A prompt is a list of segments, each a (seed, length) pair of seeded token ids: a system prompt's
# seed is (seed, 0, system, full length), a conversation's (seed, 1, conversation, segment, part).
Segment = tuple[tuple[int, ...], int]


def load_azure(path: str, limit: int | None = None) -> list[AzureRow]:
    """Read the Azure trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    rows: list[AzureRow] = []
    t0 = None
    try:
        with open(path, newline="") as f:
            for i, rec in enumerate(csv.DictReader(f)):
                if limit is not None and len(rows) >= limit:
                    break
                try:
                    t = datetime.fromisoformat(rec["TIMESTAMP"].strip()[:26])
                    t0 = t0 or t
                    rows.append(AzureRow((t - t0).total_seconds(), max(1, int(rec["ContextTokens"])),
                                         max(1, int(rec["GeneratedTokens"]))))
                except (KeyError, ValueError, TypeError) as e:
                    raise BenchInputError(f"{path}:{i + 2}: bad trace line ({e})") from None
    except OSError as e:
        raise BenchInputError(f"cannot read trace {path}: {e}") from None
    if not rows:
        raise BenchInputError(f"trace {path} has no requests")
    return rows


@dataclass(slots=True)
class _Session:
    key: int
    segments: tuple[Segment, ...]
    turn: int = 1
    prompt_len: int = 0         # the last turn's
    reply_len: int = 0


def session_specs(rows: list[AzureRow], vocab_size: int, seed: int, speedup: float = 1.0,
                  cfg: SessionsConfig = SessionsConfig()) -> tuple[list[RequestSpec], dict]:
    """The conversations' requests in arrival order, and a few facts about them."""
    rng = np.random.default_rng([seed, 11])
    weights = 1.0 / np.arange(1, cfg.num_system_prompts + 1)
    weights /= weights.sum()
    n = len(rows)
    sessions: list[_Session] = []
    # per conversation: when its user is ready for the next turn, the context that turn needs at
    # least, and when its last turn arrived
    ready_s, need_len, last_s = np.empty(n), np.empty(n, dtype=np.int64), np.empty(n)
    specs: list[RequestSpec] = []
    turns = np.empty(n, dtype=np.int64)
    for i, row in enumerate(rows):
        m = len(sessions)
        fit = np.flatnonzero((ready_s[:m] <= row.arrival_s) & (need_len[:m] <= row.context_tokens)
                             & (row.arrival_s - last_s[:m] <= cfg.max_idle_s))
        if len(fit) and rng.random() >= cfg.new_session_prob:
            j = int(fit[rng.integers(len(fit))])
            s = sessions[j]
            user = row.context_tokens - s.prompt_len - s.reply_len
            k = len(s.segments)
            s.segments += (((seed, 1, s.key, k, 1), s.reply_len), ((seed, 1, s.key, k, 2), user))
            s.turn += 1
        else:
            j = m
            system = int(rng.choice(cfg.num_system_prompts, p=weights))
            sys_len = min(cfg.system_prompt_tokens, row.context_tokens // 2)
            first: tuple[Segment, ...] = (((seed, 0, system, cfg.system_prompt_tokens), sys_len),) if sys_len else ()
            s = _Session(j, first + (((seed, 1, j, 0, 2), row.context_tokens - sys_len),))
            sessions.append(s)
        s.prompt_len, s.reply_len = row.context_tokens, row.generated_tokens
        ready_s[j] = row.arrival_s + row.generated_tokens / cfg.reading_tokens_per_s + cfg.think_s
        need_len[j] = row.context_tokens + row.generated_tokens + cfg.min_user_tokens
        last_s[j] = row.arrival_s
        turns[i] = s.turn
        specs.append(RequestSpec(row.context_tokens, row.generated_tokens, _Prompt(s.segments, vocab_size),
                                 row.arrival_s / speedup, cache_key=f"conv-{seed}-{s.key}"))
    facts = {"sessions": len(sessions), "mean_turns": round(n / len(sessions), 2),
             "max_turns": int(turns.max()), "share_continuing": round(float((turns > 1).mean()), 3)}
    return specs, facts


class _Prompt:
    """make_prompt for one turn: its segments' seeded tokens, concatenated (built on send)."""

    __slots__ = ("segments", "vocab_size")

    def __init__(self, segments: tuple[Segment, ...], vocab_size: int) -> None:
        self.segments, self.vocab_size = segments, vocab_size

    def __call__(self) -> np.ndarray:
        return np.concatenate([_segment(seed, n, self.vocab_size) for seed, n in self.segments])


def _segment(seed: tuple[int, ...], n: int, vocab_size: int) -> np.ndarray:
    """A segment's tokens; a system prompt's seed (tag 0) ends with its full length, of which it
    takes the first n."""
    if seed[1] == 0:
        return random_prompt(seed, seed[3], vocab_size)[:n]
    return random_prompt(seed, n, vocab_size)
