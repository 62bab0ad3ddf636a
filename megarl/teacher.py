"""On-policy distillation's teacher: the checks on a `--teacher` checkpoint (torch-free; the model itself is a
frozen `MegatronPolicy`, built in `megarl.trainer.build.build_teacher`, its objective in `megarl.algorithms.distill`).
"""

from __future__ import annotations

import json

from megarl.errors import ConfigError


def check_teacher_tokenizer(student: str, teacher: str) -> None:
    """The teacher scores the student's token ids, so both must use one tokenizer: the same vocabulary (every token
    string with the same id) and the same special tokens. A clear error otherwise."""
    from transformers import AutoTokenizer

    try:
        t = AutoTokenizer.from_pretrained(teacher)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--teacher {teacher}: no tokenizer could be loaded from it ({e})") from e
    s = AutoTokenizer.from_pretrained(student)
    sv, tv = s.get_vocab(), t.get_vocab()
    if sv != tv:
        differ = sorted(set(sv.items()) ^ set(tv.items()), key=lambda kv: kv[1])[:3]
        raise ConfigError(f"--teacher {teacher}: its tokenizer differs from --hf-checkpoint {student}'s "
                          f"({len(tv)} vs {len(sv)} tokens; first differences {differ}); on-policy distillation "
                          "needs the same tokenizer (the teacher scores the student's token ids)")
    if (s.eos_token_id, s.pad_token_id) != (t.eos_token_id, t.pad_token_id):
        raise ConfigError(f"--teacher {teacher}: its special tokens (eos {t.eos_token_id}, pad {t.pad_token_id}) "
                          f"differ from --hf-checkpoint's (eos {s.eos_token_id}, pad {s.pad_token_id})")


# -- a remote teacher over HTTP ----------------------------------------------------------------------------------------
#
# The request and answer are SGLang's `/generate` with prompt log-probs (vLLM's `prompt_logprobs` carry the same
# numbers): POST {input_ids: [[ids], ...], sampling_params: {max_new_tokens: 0, temperature}, return_logprob: true,
# logprob_start_len: 0} -> [{meta_info: {input_token_logprobs: [[logprob or null, id, null], ...]}}, ...], one per
# row, the first position's log-prob null (nothing predicts it). With `top_logprobs_num: K` (`--distill-topk`) each
# answer also has `meta_info.input_top_logprobs`: one entry a position, null at the first, else the K most likely
# tokens there as [[logprob, id, null], ...] (SGLang's `detokenize_top_logprobs_tokens`). `serve_teacher` answers
# it from any `score(rows, temperature) -> list[list[float]]` (and `top(rows, temperature, k)` for the top-K);
# `HTTPTeacher` asks it and gives the trainer [B, S - 1] (and [B, S - 1, K]).

GENERATE_PATH = "/generate"


def teacher_request(rows: list[list[int]], temperature: float, top_k: int = 0) -> dict:
    request = {"input_ids": rows, "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
               "return_logprob": True, "logprob_start_len": 0}
    if top_k:
        request["top_logprobs_num"] = top_k
    return request


def _answers(answer, rows: list[list[int]], url: str) -> list:
    if isinstance(answer, dict):
        answer = [answer]
    if not isinstance(answer, list) or len(answer) != len(rows):
        raise ValueError(f"teacher {url}: expected a list of {len(rows)} answers, got {type(answer).__name__}"
                         f"{' of ' + str(len(answer)) if isinstance(answer, list) else ''}")
    return answer


def parse_answer(answer, rows: list[list[int]], url: str) -> list[list[float]]:
    """Each row's log-probs of its tokens 1..n-1 from an SGLang-shaped answer; errors name the server and what is
    wrong."""
    out = []
    for i, (a, ids) in enumerate(zip(_answers(answer, rows, url), rows)):
        try:
            entries = a["meta_info"]["input_token_logprobs"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"teacher {url}: answer {i} has no meta_info.input_token_logprobs") from e
        if len(entries) != len(ids) or [int(e[1]) for e in entries] != list(ids):
            raise ValueError(f"teacher {url}: answer {i} scores other tokens than the {len(ids)} sent")
        out.append([float(e[0]) for e in entries[1:]])
    return out


def parse_top_answer(answer, rows: list[list[int]], k: int, url: str) -> list[list[list[tuple[float, int]]]]:
    """Each row's top-`k` (log-prob, id) pairs at positions 1..n-1 (what predicts token t, from t - 1) from an
    SGLang-shaped answer's `meta_info.input_top_logprobs`; a server that gives none is refused naming the flag."""
    out = []
    for i, (a, ids) in enumerate(zip(_answers(answer, rows, url), rows)):
        top = a.get("meta_info", {}).get("input_top_logprobs") if isinstance(a, dict) else None
        if top is None:
            raise ConfigError(f"--distill-topk {k}: teacher {url} gives no top-k log-probs (answer {i} has no "
                              "meta_info.input_top_logprobs for top_logprobs_num); serve it with SGLang or "
                              "serve_teacher(score, top=...), or use --distill-topk 0")
        if len(top) != len(ids):
            raise ValueError(f"teacher {url}: answer {i} has top-k log-probs at {len(top)} positions for "
                             f"{len(ids)} tokens")
        row = []
        for t, entries in enumerate(top[1:], start=1):
            if not entries or len(entries) < k:
                raise ValueError(f"teacher {url}: answer {i} gives {len(entries or [])} top log-probs at position "
                                 f"{t}, --distill-topk asks {k}")
            row.append([(float(e[0]), int(e[1])) for e in entries[:k]])
        out.append(row)
    return out


class HTTPTeacher:
    """A teacher served over HTTP (SGLang, vLLM behind an adapter, or `serve_teacher`): `logprobs` as
    `MegatronPolicy.logprobs` gives them, [B, S - 1] (column t: the log-prob of token t + 1), 0 past each row's
    length, and `topk_logprobs` as `MegatronPolicy.topk_logprobs`. The same on every rank that asks (no
    collective)."""

    def __init__(self, url: str, timeout_s: float = 300.0, max_rows: int = 64):
        self.url, self.timeout_s, self.max_rows = url.rstrip("/"), timeout_s, max_rows

    def _ask(self, rows: list[list[int]], temperature: float, top_k: int = 0):
        import urllib.error
        import urllib.request

        data = json.dumps(teacher_request(rows, temperature, top_k)).encode()
        req = urllib.request.Request(self.url + GENERATE_PATH, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if top_k and e.code == 400:
                raise ConfigError(f"--distill-topk {top_k}: teacher {self.url} refused a top-k log-prob request "
                                  f"(top_logprobs_num): {e.read().decode(errors='replace')[:300]}") from e
            raise RuntimeError(f"teacher {self.url}: request failed ({e})") from e
        except OSError as e:
            raise RuntimeError(f"teacher {self.url}: request failed ({e})") from e

    @staticmethod
    def _rows(tokens, lengths):
        B, S = tokens.shape
        lengths = lengths.tolist() if lengths is not None else [S] * B
        return [tokens[b, : int(n)].tolist() for b, n in enumerate(lengths)]

    def logprobs(self, tokens, *, lengths=None, temperature: float = 1.0, **_):
        import torch

        rows = self._rows(tokens, lengths)
        out = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.float32)
        for lo in range(0, len(rows), self.max_rows):
            chunk = rows[lo: lo + self.max_rows]
            for b, values in enumerate(parse_answer(self._ask(chunk, temperature), chunk, self.url), start=lo):
                out[b, : len(values)] = torch.tensor(values, dtype=torch.float32)
        return out

    def topk_logprobs(self, tokens, k: int, *, lengths=None, temperature: float = 1.0, **_):
        """(ids [B, S - 1, k] long, log-probs [B, S - 1, k] float32), 0 past each row's length."""
        import torch

        rows = self._rows(tokens, lengths)
        ids = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, k, dtype=torch.long)
        logp = torch.zeros(ids.shape, dtype=torch.float32)
        for lo in range(0, len(rows), self.max_rows):
            chunk = rows[lo: lo + self.max_rows]
            answer = self._ask(chunk, temperature, top_k=k)
            for b, row in enumerate(parse_top_answer(answer, chunk, k, self.url), start=lo):
                if row:
                    pairs = torch.tensor(row, dtype=torch.float64)  # [n - 1, k, (log-prob, id)]
                    logp[b, : len(row)] = pairs[..., 0].float()
                    ids[b, : len(row)] = pairs[..., 1].long()
        return ids, logp

    def check_topk(self, k: int) -> None:
        """Asks the server for the top-`k` of a two-token row: a clear error at start, not after the first
        rollout, when it gives none (`--distill-topk`)."""
        rows = [[0, 0]]
        parse_top_answer(self._ask(rows, 1.0, top_k=k), rows, k, self.url)


class HFScorer:
    """`score(rows, temperature)` from a `transformers` causal LM: each row's log-probs of its tokens 1..n-1, the
    logits divided by the temperature as the engine divides them; `top(rows, temperature, k)`: each row's top-k
    (log-prob, id) pairs at those positions, largest first."""

    def __init__(self, checkpoint: str, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=getattr(torch, dtype)).eval()

    def _logp(self, ids: list[int], temperature: float):
        import torch

        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0, :-1].float() / temperature
        return torch.log_softmax(logits, dim=-1)

    def __call__(self, rows: list[list[int]], temperature: float) -> list[list[float]]:
        import torch

        return [self._logp(ids, temperature).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()
                for ids in rows]

    def top(self, rows: list[list[int]], temperature: float, k: int) -> list[list[list[tuple[float, int]]]]:
        out = []
        for ids in rows:
            values, top_ids = self._logp(ids, temperature).topk(k, dim=-1)
            out.append([list(zip(v, i)) for v, i in zip(values.tolist(), top_ids.tolist())])
        return out


def hf_scorer(checkpoint: str, dtype: str = "float32") -> HFScorer:
    """`HFScorer(checkpoint)`: serve it with `serve_teacher(s, top=s.top)` (`top` for `--distill-topk`)."""
    return HFScorer(checkpoint, dtype)


def serve_teacher(score, host: str = "127.0.0.1", port: int = 0, top=None):
    """An HTTP server answering SGLang-shaped prompt log-prob requests from `score`, and top-k ones
    (`top_logprobs_num`) from `top(rows, temperature, k)` when given (refused with a 400 otherwise); returns the
    started `ThreadingHTTPServer` (its `server_address` has the port; `shutdown()` stops it)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format, *args):
            pass

        def _send(self, status: int, payload) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            if self.path != GENERATE_PATH:
                return self._send(404, {"error": f"unknown path {self.path}; POST {GENERATE_PATH}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                rows = body["input_ids"]
                rows = [rows] if rows and isinstance(rows[0], int) else rows
                temperature = float(body.get("sampling_params", {}).get("temperature", 1.0))
                if temperature <= 0:
                    raise ValueError(f"temperature must be > 0, got {temperature}")
                k = int(body.get("top_logprobs_num") or 0)
                if k and top is None:
                    raise ValueError("this teacher serves no top-k log-probs (top_logprobs_num)")
            except (ValueError, KeyError, TypeError) as e:
                return self._send(400, {"error": f"bad request: {e}"})
            answers = []
            tops = top(rows, temperature, k) if k else [None] * len(rows)
            for ids, lps, row_top in zip(rows, score(rows, temperature), tops):
                entries = [[None, ids[0], None]] + [[lp, t, None] for lp, t in zip(lps, ids[1:])]
                meta = {"input_token_logprobs": entries}
                if row_top is not None:
                    meta["input_top_logprobs"] = [None] + [[[lp, t, None] for lp, t in pos] for pos in row_top]
                answers.append({"meta_info": meta})
            self._send(200, answers)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# -- several teachers, chosen per row ------------------------------------------------------------------------------


def parse_teachers(spec: str) -> dict[str, str]:
    """`--teacher`: one source (an HF checkpoint directory or an http(s) URL), or several named ones,
    `name=SOURCE,name=SOURCE`, chosen per data row by its `teacher` field (a row without one gets the first).
    {name: source}, the single source under the name ""."""
    if "=" not in spec.split(",")[0] or spec.startswith(("http://", "https://")):
        if "," in spec:
            raise ConfigError(f"--teacher {spec}: several teachers are given as name=SOURCE,name=SOURCE")
        return {"": spec}
    out: dict[str, str] = {}
    for part in spec.split(","):
        name, eq, source = part.partition("=")
        name, source = name.strip(), source.strip()
        if not eq or not name or not source:
            raise ConfigError(f"--teacher {spec}: {part!r} is not name=SOURCE")
        if name in out:
            raise ConfigError(f"--teacher {spec}: the name {name!r} is given twice")
        out[name] = source
    return out


class Teachers:
    """Several teachers, each row's log-probs from the one its data row names (`PromptRecord.teacher`; "" = the
    first). `teachers`: {name: an object with `logprobs(tokens, **kw)`}; `row_teacher[i]`: dataset row i's name.
    Every teacher runs on the rows that name it only (a Megatron teacher's forward is collective: every rank runs
    every teacher, on its own rows, possibly none)."""

    def __init__(self, teachers: dict, row_teacher: list[str]):
        self.teachers, self.names = teachers, list(teachers)
        unknown = sorted({t for t in row_teacher if t and t not in teachers})
        if unknown:
            raise ConfigError(f"data rows name teachers {unknown} that --teacher does not give (it gives "
                              f"{self.names})")
        self.row_teacher = [t or self.names[0] for t in row_teacher]

    def _each(self, tokens, rows, lengths, ask):
        """`ask(teacher, tokens, lengths)` of each teacher on its own rows, put back in the batch's row order (a
        tensor, or a tuple of them); None off the last pipeline stage."""
        import torch

        if len(rows) != tokens.shape[0]:
            raise ValueError(f"teachers: {len(rows)} row indices for {tokens.shape[0]} sequences")
        chosen = [self.row_teacher[r] for r in rows]
        out, several = None, False
        for name, teacher in self.teachers.items():
            idx = [b for b, c in enumerate(chosen) if c == name]
            if not idx:
                continue
            sel = torch.tensor(idx)
            got = ask(teacher, tokens[sel], None if lengths is None else lengths[sel])
            if got is None:  # not the last pipeline stage (every teacher still runs: the forwards are collective)
                continue
            several = isinstance(got, tuple)
            parts = got if several else (got,)
            if out is None:
                out = tuple(p.new_zeros((tokens.shape[0], *p.shape[1:])) for p in parts)
            for o, p in zip(out, parts):
                o[sel.to(p.device)] = p
        return out if out is None or several else out[0]

    def logprobs(self, tokens, *, rows, lengths=None, **kw):
        return self._each(tokens, rows, lengths, lambda t, x, n: t.logprobs(x, lengths=n, **kw))

    def topk_logprobs(self, tokens, k: int, *, rows, lengths=None, **kw):
        """Each row's teacher's top-`k` (ids [B, S - 1, k], log-probs [B, S - 1, k]), as `logprobs`."""
        return self._each(tokens, rows, lengths, lambda t, x, n: t.topk_logprobs(x, k, lengths=n, **kw))
