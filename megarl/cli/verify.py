"""`megarl-verify`: score a jsonl of responses offline with a registered verifier and summarise the result.

    megarl-verify rows.jsonl --verifier math [--response-key response] [--gold-key gold] [--label-key label]
                  [--category-key category] [--output scored.jsonl] [--compare math-verify] [--strict]
                  [--plugins my_verifiers] [--code-reward fraction --sandbox docker ...]

Rows are scored in reward worker processes, as in training: `--plugins` imports modules (or .py files) here and in
every worker, so a verifier they register can be named; the verifier and sandbox flags are the trainer's own
(`megarl.config.RewardConfig`, `SandboxConfig`) and reach the verifiers the same way.

Prints outcome counts, accuracy against labels when rows carry one (with false-positive and false-negative
rates), a per-category breakdown when rows carry a category, latency percentiles and the slowest cases.
`--output` writes one JSON object per input line, in input order (bad lines too, with their `error`).
A bad line (not JSON, not an object, a missing key) is reported with its line number and skipped; `--strict`
stops at the first one instead. Exit status: 0 all lines scored, 1 some lines were bad, 2 usage error or
`--strict` failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from megarl.config import ConfigError, RewardConfig, SandboxConfig, _convert, flag_specs, verifier_options
from megarl.verifiers.base import OUTCOMES

# The trainer's verifier and sandbox flags; the pool's own size and timeout are --workers and --timeout here.
_VERIFIER_FLAGS = {flag: spec for flag, spec in flag_specs().items()
                   if spec.section in ("reward", "sandbox") and spec.name not in ("reward_workers", "reward_timeout")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megarl-verify", description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="jsonl file, one object per line")
    p.add_argument("--verifier", default="math", help="registered verifier name (default: math)")
    p.add_argument("--response-key", default="response", help="field holding the model response")
    p.add_argument("--gold-key", default="gold", help="field holding the ground truth")
    p.add_argument("--label-key", default="label", help="optional field: is the response correct (true/false)")
    p.add_argument("--category-key", default="category", help="optional field for a per-category breakdown")
    p.add_argument("--id-key", default="id", help="optional field copied to --output rows")
    p.add_argument("--output", help="write per-row results here (jsonl, input order)")
    p.add_argument("--compare", choices=["math-verify"], help="also run HF math-verify and list disagreements")
    p.add_argument("--strict", action="store_true", help="stop at the first bad line instead of skipping it")
    p.add_argument("--workers", type=int, default=0, help="reward worker processes (0 = one per CPU, max 16)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds allowed per row before it is a timeout")
    p.add_argument("--slowest", type=int, default=5, help="how many of the slowest rows to list")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plugins", default="", help="comma-separated modules (or .py files) to import here and in every "
                   "reward worker: verifiers they register can be named with --verifier")
    for flag, spec in _VERIFIER_FLAGS.items():
        if spec.type is bool:
            p.add_argument(flag, nargs="?", const="true", default=None, metavar="true|false", help=spec.help)
        else:
            p.add_argument(flag, default=None, help=spec.help)
    return p


def verifier_settings(args) -> dict[str, dict]:
    """The verifiers' keyword arguments from the verifier and sandbox flags given (defaults otherwise)."""
    values = {}
    for flag, spec in _VERIFIER_FLAGS.items():
        raw = getattr(args, spec.name)
        if raw is not None:
            values[spec.name] = _convert(spec, raw, "command line")
    sections = {cls: {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
                for cls in (RewardConfig, SandboxConfig)}
    return verifier_options(RewardConfig(**sections[RewardConfig]), SandboxConfig(**sections[SandboxConfig]))


class InputError(Exception):
    pass


def read_rows(path: str, keys: tuple[str, str], strict: bool) -> tuple[list[dict], list[dict]]:
    """(good rows with their line numbers, bad lines with the reason), both in file order."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{path}: no such file")
    good, bad = [], []
    with p.open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            error = None
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row, error = None, f"not valid JSON ({e.msg})"
            if error is None and not isinstance(row, dict):
                error = f"expected a JSON object, got {type(row).__name__}"
            if error is None:
                missing = [k for k in keys if k not in row]
                if missing:
                    error = f"missing key {missing[0]!r} (keys: {', '.join(row) or 'none'})"
            if error is not None:
                message = f"{path}:{lineno}: {error}"
                if strict:
                    raise InputError(message + " (--strict)")
                print(f"megarl-verify: {message}; line skipped", file=sys.stderr)
                bad.append({"line": lineno, "error": error})
            else:
                good.append({"line": lineno, "row": row})
    return good, bad


def score_rows(rows: list[dict], args) -> list:
    from megarl.registry import load_plugins
    from megarl.verifiers import verifier_names
    from megarl.verifiers.pool import RewardPool

    try:
        plugins = load_plugins(args.plugins)
    except ValueError as e:
        raise InputError(str(e)) from None
    if args.verifier not in verifier_names():
        raise InputError(f"unknown verifier {args.verifier!r}; registered: {', '.join(verifier_names())}")
    requests = [(args.verifier, str(r["row"][args.response_key]), r["row"][args.gold_key]) for r in rows]
    chunk = 256
    bar = None
    if not args.no_progress and len(requests) > chunk:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="row", file=sys.stderr, desc="megarl-verify")
    results = []
    with RewardPool(workers=args.workers, timeout_s=args.timeout, preload=plugins,
                    options=verifier_settings(args)) as pool:
        for i in range(0, len(requests), chunk):
            batch, _ = pool.score(requests[i : i + chunk])
            results.extend(batch)
            if bar is not None:
                bar.update(len(batch))
    if bar is not None:
        bar.close()
    return results


def mathverify_check(response: str, gold) -> bool:
    """HF math-verify's verdict with its default `parse`/`verify`; the gold is given boxed, as a dataset answer."""
    from math_verify import parse, verify

    try:
        return bool(verify(parse("\\boxed{" + str(gold) + "}"), parse(response)))
    except Exception:  # noqa: BLE001 - math-verify raising counts as "not correct"
        return False


def _label(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    return None


def summarize(rows: list[dict], results: list, args, compare: list | None, out=None) -> None:
    out = out or sys.stdout
    n = len(results)
    say = lambda s="": print(s, file=out)  # noqa: E731
    say(f"megarl-verify: {n} rows scored with verifier {args.verifier!r}")
    counts = Counter(r.outcome for r in results)
    say(f"  {'outcome':<14}{'rows':>7}{'share':>9}")
    for o in OUTCOMES:
        say(f"  {o:<14}{counts[o]:>7}{100 * counts[o] / max(n, 1):>8.1f}%")
    labels = [_label(r["row"].get(args.label_key)) for r in rows]
    labelled = [(lab, res, i) for i, (lab, res) in enumerate(zip(labels, results)) if lab is not None]
    if labelled:
        say()
        say(_accuracy_line("megarl", [(lab, res.score == 1.0) for lab, res, _ in labelled]))
        if compare is not None:
            say(_accuracy_line("math-verify", [(lab, compare[i]) for lab, _, i in labelled]))
        cats = defaultdict(list)
        for lab, res, i in labelled:
            cat = rows[i]["row"].get(args.category_key)
            if cat is not None:
                cats[str(cat)].append((lab, res.score == 1.0, compare[i] if compare is not None else None))
        if cats:
            say()
            head = f"  {'category':<22}{'rows':>6}{'megarl':>9}" + (f"{'math-verify':>13}" if compare else "")
            say(head)
            for cat in sorted(cats):
                items = cats[cat]
                line = f"  {cat:<22}{len(items):>6}{100 * sum(l == m for l, m, _ in items) / len(items):>8.1f}%"
                if compare is not None:
                    line += f"{100 * sum(l == c for l, _, c in items) / len(items):>12.1f}%"
                say(line)
    secs = sorted(r.seconds for r in results)
    if secs:
        pick = lambda q: secs[min(len(secs) - 1, int(q * len(secs)))]  # noqa: E731
        say()
        say(f"latency: p50 {1000 * pick(0.5):.1f} ms, p90 {1000 * pick(0.9):.1f} ms, p99 {1000 * pick(0.99):.1f} ms, "
            f"max {1000 * secs[-1]:.1f} ms")
        slow = sorted(range(n), key=lambda i: -results[i].seconds)[: args.slowest]
        say("slowest:")
        for i in slow:
            say(f"  line {rows[i]['line']:>6}  {1000 * results[i].seconds:9.1f} ms  {results[i].outcome:<12}"
                f"{_short(rows[i]['row'].get(args.id_key, ''))}")
    if compare is not None:
        diff = [i for i in range(n) if (results[i].score == 1.0) != compare[i]]
        say()
        say(f"disagreements with math-verify: {len(diff)} of {n}")
        for i in diff:
            lab = labels[i]
            say(f"  line {rows[i]['line']:>6}  megarl {results[i].outcome:<11} math-verify "
                f"{'correct' if compare[i] else 'not':<8} label {lab!s:<5} gold {_short(rows[i]['row'][args.gold_key])}"
                f"  extracted {_short(results[i].extracted)}")


def _accuracy_line(name: str, pairs: list[tuple[bool, bool]]) -> str:
    n = len(pairs)
    acc = sum(lab == pred for lab, pred in pairs) / n
    neg = [pred for lab, pred in pairs if not lab]
    pos = [pred for lab, pred in pairs if lab]
    fpr = sum(neg) / len(neg) if neg else 0.0
    fnr = sum(not p for p in pos) / len(pos) if pos else 0.0
    return f"{name:<12} accuracy {100 * acc:5.1f}% on {n} labelled rows (false positives {100 * fpr:.1f}%, " \
           f"false negatives {100 * fnr:.1f}%)"


def _short(value, width: int = 40) -> str:
    s = str(value) if value is not None else "-"
    s = s.replace("\n", " ")
    return s if len(s) <= width else s[: width - 3] + "..."


def write_output(path: str, rows: list[dict], results: list, bad: list[dict], args, compare) -> None:
    out = []
    for i, (r, res) in enumerate(zip(rows, results)):
        obj = {"line": r["line"]}
        if args.id_key in r["row"]:
            obj["id"] = r["row"][args.id_key]
        obj.update(score=float(res.score), outcome=res.outcome, extracted=res.extracted, normalized=res.normalized,
                   seconds=res.seconds)
        if compare is not None:
            obj["math_verify"] = compare[i]
        out.append(obj)
    out.extend(bad)
    out.sort(key=lambda o: o["line"])
    with open(path, "w", encoding="utf-8") as fh:
        for obj in out:
            fh.write(json.dumps(obj, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.compare == "math-verify":
            try:
                import math_verify  # noqa: F401
            except ImportError:
                raise InputError("--compare math-verify needs the math-verify package (pip install math-verify)")
        verifier_settings(args)  # a bad value stops here, before any row is read
        rows, bad = read_rows(args.data, (args.response_key, args.gold_key), args.strict)
        results = score_rows(rows, args) if rows else []
    except (InputError, ConfigError) as e:
        print(f"megarl-verify: error: {e}", file=sys.stderr)
        return 2
    compare = None
    if args.compare:
        compare = [mathverify_check(str(r["row"][args.response_key]), r["row"][args.gold_key]) for r in rows]
    summarize(rows, results, args, compare)
    if bad:
        print(f"{len(bad)} bad line(s) skipped: {', '.join(str(b['line']) for b in bad[:20])}", file=sys.stderr)
    if args.output:
        write_output(args.output, rows, results, bad, args, compare)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
