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
# row, the first position's log-prob null (nothing predicts it). `serve_teacher` answers it from any
# `score(rows, temperature) -> list[list[float]]`; `HTTPTeacher` asks it and gives the trainer [B, S - 1].

GENERATE_PATH = "/generate"


def teacher_request(rows: list[list[int]], temperature: float) -> dict:
    return {"input_ids": rows, "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "return_logprob": True, "logprob_start_len": 0}


def parse_answer(answer, rows: list[list[int]], url: str) -> list[list[float]]:
    """Each row's log-probs of its tokens 1..n-1 from an SGLang-shaped answer; errors name the server and what is
    wrong."""
    if isinstance(answer, dict):
        answer = [answer]
    if not isinstance(answer, list) or len(answer) != len(rows):
        raise ValueError(f"teacher {url}: expected a list of {len(rows)} answers, got {type(answer).__name__}"
                         f"{' of ' + str(len(answer)) if isinstance(answer, list) else ''}")
    out = []
    for i, (a, ids) in enumerate(zip(answer, rows)):
        try:
            entries = a["meta_info"]["input_token_logprobs"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"teacher {url}: answer {i} has no meta_info.input_token_logprobs") from e
        if len(entries) != len(ids) or [int(e[1]) for e in entries] != list(ids):
            raise ValueError(f"teacher {url}: answer {i} scores other tokens than the {len(ids)} sent")
        out.append([float(e[0]) for e in entries[1:]])
    return out


class HTTPTeacher:
    """A teacher served over HTTP (SGLang, vLLM behind an adapter, or `serve_teacher`): `logprobs` as
    `MegatronPolicy.logprobs` gives them, [B, S - 1] (column t: the log-prob of token t + 1), 0 past each row's
    length. The same on every rank that asks (no collective)."""

    def __init__(self, url: str, timeout_s: float = 300.0, max_rows: int = 64):
        self.url, self.timeout_s, self.max_rows = url.rstrip("/"), timeout_s, max_rows

    def logprobs(self, tokens, *, lengths=None, temperature: float = 1.0, **_):
        import urllib.request

        import torch

        B, S = tokens.shape
        lengths = lengths.tolist() if lengths is not None else [S] * B
        rows = [tokens[b, : int(n)].tolist() for b, n in enumerate(lengths)]
        out = torch.zeros(B, S - 1, dtype=torch.float32)
        for lo in range(0, B, self.max_rows):
            chunk = rows[lo: lo + self.max_rows]
            data = json.dumps(teacher_request(chunk, temperature)).encode()
            req = urllib.request.Request(self.url + GENERATE_PATH, data=data,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    answer = json.loads(r.read())
            except OSError as e:
                raise RuntimeError(f"teacher {self.url}: request failed ({e})") from e
            for b, values in enumerate(parse_answer(answer, chunk, self.url), start=lo):
                out[b, : len(values)] = torch.tensor(values, dtype=torch.float32)
        return out


def hf_scorer(checkpoint: str, dtype: str = "float32"):
    """`score(rows, temperature)` from a `transformers` causal LM: each row's log-probs of its tokens 1..n-1, the
    logits divided by the temperature as the engine divides them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=getattr(torch, dtype)).eval()

    @torch.no_grad()
    def score(rows: list[list[int]], temperature: float) -> list[list[float]]:
        out = []
        for ids in rows:
            x = torch.tensor([ids])
            logits = model(x).logits[0, :-1].float() / temperature
            lp = torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:].unsqueeze(-1)).squeeze(-1)
            out.append(lp.tolist())
        return out

    return score


def serve_teacher(score, host: str = "127.0.0.1", port: int = 0):
    """An HTTP server answering SGLang-shaped prompt log-prob requests from `score`; returns the started
    `ThreadingHTTPServer` (its `server_address` has the port; `shutdown()` stops it)."""
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
            except (ValueError, KeyError, TypeError) as e:
                return self._send(400, {"error": f"bad request: {e}"})
            answers = []
            for ids, lps in zip(rows, score(rows, temperature)):
                entries = [[None, ids[0], None]] + [[lp, t, None] for lp, t in zip(lps, ids[1:])]
                answers.append({"meta_info": {"input_token_logprobs": entries}})
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

    def logprobs(self, tokens, *, rows, lengths=None, **kw):
        import torch

        if len(rows) != tokens.shape[0]:
            raise ValueError(f"teachers: {len(rows)} row indices for {tokens.shape[0]} sequences")
        chosen = [self.row_teacher[r] for r in rows]
        out = None
        for name, teacher in self.teachers.items():
            idx = [b for b, c in enumerate(chosen) if c == name]
            if not idx:
                continue
            sel = torch.tensor(idx)
            got = teacher.logprobs(tokens[sel], lengths=None if lengths is None else lengths[sel], **kw)
            if got is None:  # not the last pipeline stage (every teacher still runs: the forwards are collective)
                continue
            if out is None:
                out = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, dtype=got.dtype, device=got.device)
            out[sel.to(got.device)] = got
        return out
