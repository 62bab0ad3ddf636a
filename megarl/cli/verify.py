"""`megarl-verify`: score a jsonl of responses offline with the registered verifiers and summarise the result.

    megarl-verify runs/<run>/samples.jsonl                 # saved rollouts: each row names its verifier and answer
    megarl-verify rows.jsonl --verifier hf_rm --reward-model DIR --prompt-key prompt --output scored.jsonl
    megarl-verify rows.jsonl [--verifier math] [--response-key response] [--label-key answer]
                  [--verifier-key verifier] [--correct-key correct] [--category-key category] [--output scored.jsonl]
                  [--compare math-verify] [--strict] [--workers -1] [--plugins my_verifiers]
                  [--code-reward fraction --sandbox docker ...]

Rows follow the training data's conventions: the ground truth is the row's `answer` (`--label-key`, as in
training), the verifier is the row's own `verifier` field (`--verifier-key`), and `--verifier` is the one for rows
without such a field (the trainer's `--default-verifier`). The trainer's `samples.jsonl` carries all three, so
saved rollouts are re-scored with no flags. `--workers` means what the trainer's `--reward-workers` means: -1 one
process per CPU, 0 this process (each verifier under its own budget), N that many; a row's limit is the smaller
of `--timeout` and its verifier's own budget (the math verifier's 5 s). `--plugins` imports modules (or .py files)
here and in every worker, so a verifier they register can be named; the verifier and sandbox flags are the
trainer's own (`megarl.config.RewardConfig`, `SandboxConfig`) and reach the verifiers the same way.

A row's verifier may be any reward spec the trainer takes (`megarl.reward.compose`): a reward model (`hf_rm`
with `--reward-model DIR`, `remote_rm` with `--remote-rm-url`, the trainer's flags) or a composition ("math >
hf_rm"); a reward model reads the row's prompt (`--prompt-key`, needed then) and no ground truth unless a rule in
the spec does. A row with `chosen` and `rejected` responses (`--chosen-key`, `--rejected-key`) instead of one
response is a preference pair: both are scored, and the summary gives the pairwise accuracy (the share of pairs
whose chosen response scores higher).

Prints outcome counts, accuracy against the `--correct-key` field when rows carry one (true/false: is the response
correct; with false-positive and false-negative rates), a per-category breakdown when rows carry a category,
latency percentiles and the slowest cases. `--compare math-verify` also runs HF math-verify on the rows scored
by the `math` verifier. `--output` writes one JSON object per input line, in input order (bad lines too, with
their `error`). A bad line (not JSON, not an object, a missing key, an unknown verifier) is reported with its line
number and skipped; `--strict` stops at the first one instead. An option given in both its spellings with two
values (`--gold-key` and `--label-key`, ...) is a usage error naming both. Exit status: 0 all lines scored, 1 some
lines were bad, 2 usage error or `--strict` failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from megarl.config import FlagSpec, build_config, convert_value, flag_specs
from megarl.errors import ConfigError
from megarl.verifiers.base import OUTCOMES


def _components() -> dict[str, type]:
    """The options sections of the verifiers and reward models registered so far (`--plugins` imported)."""
    from megarl.arguments import components
    from megarl.reward.models import REWARD_MODELS
    from megarl.verifiers.base import VERIFIERS

    return components((VERIFIERS, REWARD_MODELS))


def _verifier_flags() -> dict[str, FlagSpec]:
    """The trainer's flags that reach verifiers and reward models: their own options, the sandbox's and the reward
    section's (the pool's own size and timeout are --workers and --timeout here)."""
    components = _components()
    return {flag: spec for flag, spec in flag_specs(components).items()
            if spec.section in ("reward", "sandbox", *components) and spec.name not in ("reward_workers",
                                                                                          "reward_timeout")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megarl-verify", description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="jsonl file, one object per line (a training-data or samples.jsonl row)")
    p.add_argument("--verifier", "--default-verifier", dest="verifier", default="",
                   help="registered verifier for rows without a --verifier-key field (as the trainer's "
                   "--default-verifier); rows that name one use theirs")
    p.add_argument("--verifier-key", default="verifier", help="field naming a row's verifier (default: verifier)")
    p.add_argument("--response-key", default="response", help="field holding the model response")
    p.add_argument("--prompt-key", default="prompt", help="field holding the prompt (text or chat messages), which "
                   "reward models score with the response (default: prompt)")
    p.add_argument("--chosen-key", default="chosen", help="preference pairs: field of the preferred response")
    p.add_argument("--rejected-key", default="rejected", help="preference pairs: field of the other response")
    p.add_argument("--label-key", "--gold-key", dest="label_key", default="answer",
                   help="field holding the ground truth, as the trainer's --label-key (default: answer)")
    p.add_argument("--correct-key", default="correct",
                   help="optional field: whether the response is correct (true/false), to measure the verifier")
    p.add_argument("--category-key", default="category", help="optional field for a per-category breakdown")
    p.add_argument("--id-key", default="id", help="optional field copied to --output rows")
    p.add_argument("--output", help="write per-row results here (jsonl, input order)")
    p.add_argument("--compare", choices=["math-verify"], help="also run HF math-verify on the rows the math "
                   "verifier scores, and list disagreements")
    p.add_argument("--strict", action="store_true", help="stop at the first bad line instead of skipping it")
    p.add_argument("--workers", "--reward-workers", dest="workers", type=int, default=-1,
                   help="as the trainer's --reward-workers: -1 one per CPU (at most 16), 0 in this process, N workers")
    p.add_argument("--timeout", "--reward-timeout", dest="timeout", type=float, default=10.0,
                   help="seconds a row may take in a worker (the verifier's own budget, when smaller, applies)")
    p.add_argument("--slowest", type=int, default=5, help="how many of the slowest rows to list")
    p.add_argument("--audit", action="store_true", help="also print the reward-hacking signals the verifiers "
                   "reported (`megarl.verifiers.signals`), by category, with examples")
    p.add_argument("--audit-examples", type=int, default=2, help="--audit: examples listed per category")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plugins", default="", help="comma-separated modules (or .py files) to import here and in every "
                   "reward worker: verifiers they register can be named with --verifier")
    for flag, spec in _verifier_flags().items():
        if spec.type is bool:
            p.add_argument(flag, nargs="?", const="true", default=None, metavar="true|false", help=spec.help)
        else:
            p.add_argument(flag, default=None, help=spec.help)
    return p


def verifier_settings(args) -> dict[str, dict]:
    """The keyword arguments of each verifier and reward model, from the flags given (defaults otherwise), as the
    trainer computes them (`megarl.reward.reward_options`)."""
    from megarl.reward import reward_options

    values = {}
    for _flag, spec in _verifier_flags().items():
        raw = getattr(args, spec.name, None)
        if raw is not None:
            values[spec.name] = convert_value(spec, raw, "command line")
    return reward_options(build_config(values, _components()))


class InputError(Exception):
    pass


def check_usage(args) -> tuple[str, ...]:
    """Everything the flags alone can tell, before a row is read: the plugins import, `--verifier` is
    registered, the verifier flags are valid, math-verify is there. Returns the plugin modules."""
    from megarl.registry import load_plugins
    from megarl.reward.compose import spec_error

    if args.workers < -1:
        raise InputError(f"--workers must be -1 (one per CPU), 0 (in this process) or more, got {args.workers}")
    if args.timeout <= 0:
        raise InputError(f"--timeout must be > 0 seconds, got {args.timeout}")
    try:
        plugins = load_plugins(args.plugins)
    except ValueError as e:
        raise InputError(str(e)) from None
    if args.verifier and (error := spec_error(args.verifier)):
        raise InputError(f"--verifier: {error}")
    if args.compare == "math-verify":
        try:
            import math_verify  # noqa: F401 - only to see that it is installed
        except ImportError:
            raise InputError("--compare math-verify needs the math-verify package (pip install math-verify)") from None
    verifier_settings(args)  # a bad value stops here
    return plugins


def _row_error(row, args) -> str | None:
    """Why a parsed line cannot be scored, or None."""
    from megarl.reward.compose import parse, spec_error
    from megarl.reward.models import REWARD_MODELS

    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    pair = args.response_key not in row and args.chosen_key in row and args.rejected_key in row
    name = row.get(args.verifier_key) or args.verifier
    parts = [] if not isinstance(name, str) or spec_error(name) else [p.name for p in parse(name).parts]
    needs = [] if pair else [(args.response_key, "--response-key", "response")]
    if not parts or not all(p in REWARD_MODELS for p in parts):
        needs.append((args.label_key, "--label-key", "ground truth"))
    if any(p in REWARD_MODELS for p in parts):
        needs.append((args.prompt_key, "--prompt-key", "prompt a reward model scores with the response"))
    for key, flag, what in needs:
        if key not in row:
            return f"missing key {key!r} (keys: {', '.join(row) or 'none'}); {flag} names the field holding the {what}"
    if not name:
        return f"no {args.verifier_key!r} field and no --verifier for rows without one"
    if not isinstance(name, str):
        return f"field {args.verifier_key!r} must be text"
    return spec_error(name)


def read_rows(path: str, args) -> tuple[list[dict], list[dict]]:
    """(good rows with their line numbers and verifier, bad lines with the reason), both in file order."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{path}: no such file")
    good, bad = [], []
    with p.open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                error = _row_error(row, args)
            except json.JSONDecodeError as e:
                row, error = None, f"not valid JSON ({e.msg})"
            if error is None:
                good.append({"line": lineno, "row": row, "verifier": row.get(args.verifier_key) or args.verifier})
                continue
            message = f"{path}:{lineno}: {error}"
            if args.strict:
                raise InputError(message + " (--strict)")
            print(f"megarl-verify: {message}; line skipped", file=sys.stderr)
            bad.append({"line": lineno, "error": error})
    return good, bad


def _requests(rows: list[dict], args) -> tuple[list[tuple], list]:
    """(one request per response, in order: a pair gives two; where row i's first response is)."""
    requests, first = [], []
    for r in rows:
        row = r["row"]
        first.append(len(requests))
        responses = [row[args.response_key]] if args.response_key in row else \
            [row[args.chosen_key], row[args.rejected_key]]
        requests.extend((r["verifier"], row.get(args.prompt_key), str(x), row.get(args.label_key)) for x in responses)
    return requests, first


def score_rows(rows: list[dict], args, plugins: tuple[str, ...]) -> list:
    """One result per row, in order (a pair's: (chosen, rejected)): rules in reward workers as in training, or in
    this process with --workers 0; reward models as the trainer runs them (`RoutedReward`)."""
    from megarl.reward import InProcessReward, PoolReward, RoutedReward
    from megarl.reward.pool import RewardPool

    requests, first = _requests(rows, args)
    options = verifier_settings(args)
    chunk = 256
    bar = None
    if not args.no_progress and len(requests) > chunk:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="row", file=sys.stderr, desc="megarl-verify")
    results = []
    pool = None if args.workers == 0 else RewardPool(workers=max(args.workers, 0), timeout_s=args.timeout,
                                                     preload=plugins, options=options)
    rules = InProcessReward(options) if pool is None else PoolReward(pool)
    scorer = RoutedReward(rules, options)
    try:
        for i in range(0, len(requests), chunk):
            results.extend(scorer.score(requests[i : i + chunk]))
            if bar is not None:
                bar.update(len(requests[i : i + chunk]))
    except (ValueError, RuntimeError) as e:  # a reward model that cannot start: a missing flag, a bad checkpoint
        raise InputError(str(e)) from None
    finally:
        (rules if pool is None else pool).close()
        for model in scorer.models.values():
            model.close()
        if bar is not None:
            bar.close()
    ends = first[1:] + [len(requests)]
    return [results[a] if b - a == 1 else tuple(results[a:b]) for a, b in zip(first, ends)]


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
    """The report on stdout. `compare[i]`: math-verify's verdict on row i, None where it was not asked (a row the
    math verifier does not score)."""
    out = out or sys.stdout
    n = len(results)
    say = lambda s="": print(s, file=out)
    used = Counter(r["verifier"] for r in rows)
    say(f"megarl-verify: {n} rows scored with verifier {', '.join(f'{k!r} ({v})' for k, v in sorted(used.items()))}")
    flat = [(i, x) for i, res in enumerate(results) for x in (res if isinstance(res, tuple) else (res,))]
    counts = Counter(x.outcome for _, x in flat)
    say(f"  {'outcome':<14}{'rows':>7}{'share':>9}")
    for o in OUTCOMES:
        say(f"  {o:<14}{counts[o]:>7}{100 * counts[o] / max(len(flat), 1):>8.1f}%")
    labels = [_label(r["row"].get(args.correct_key)) for r in rows]
    labelled = [(lab, res, i) for i, (lab, res) in enumerate(zip(labels, results))
                if lab is not None and not isinstance(res, tuple)]
    _reward_model_lines(say, flat, results)
    if labelled:
        say()
        say(_accuracy_line("megarl", [(lab, res.outcome == "correct") for lab, res, _ in labelled]))
        compared = [(lab, compare[i]) for lab, _, i in labelled if compare is not None and compare[i] is not None]
        if compared:
            say(_accuracy_line("math-verify", compared))
        _categories(say, rows, labelled, args, compare)
    _latency(say, rows, flat, args)
    if compare is not None:
        _disagreements(say, rows, results, labels, args, compare)


def audit(rows: list[dict], results: list, examples: int = 2, out=None) -> dict[str, list[int]]:
    """`--audit`: the reward-hacking signals of the scored rows, by category (`megarl.verifiers.signals`), with
    `examples` rows of each (line, verifier, reward, evidence, the response's start); returns category -> lines."""
    from megarl.verifiers.signals import CATEGORIES

    say = lambda s="": print(s, file=out or sys.stdout)
    seen: dict[str, list[tuple[int, str, object]]] = defaultdict(list)
    flat = [(r, x) for r, res in zip(rows, results) for x in (res if isinstance(res, tuple) else (res,))]
    for r, x in flat:
        for category, evidence in (getattr(x, "signals", None) or {}).items():
            seen[category].append((r["line"], evidence, r, x))
    flagged = sum(bool(getattr(x, "signals", None)) for _, x in flat)
    n = max(len(flat), 1)
    say()
    say(f"reward-hacking signals: {flagged} of {len(flat)} responses flagged ({100 * flagged / n:.1f}%)")
    say(f"  {'category':<18}{'rows':>7}{'share':>9}{'rewarded':>10}")
    for c in [*CATEGORIES, *sorted(set(seen) - set(CATEGORIES))]:
        hits = seen.get(c, [])
        rewarded = sum(x.score > 0 for *_, x in hits)
        say(f"  {c:<18}{len(hits):>7}{100 * len(hits) / n:>8.1f}%{rewarded:>10}")
    for c, hits in seen.items():
        say(f"  {c}:")
        for line, evidence, r, x in hits[:examples]:
            say(f"    line {line} ({r['verifier']}, reward {x.score:g}): {evidence}")
            say(f"      response: {_short(r['row'].get('response', ''), 100)}")
    return {c: [h[0] for h in hits] for c, hits in seen.items()}


def _categories(say, rows, labelled, args, compare) -> None:
    cats = defaultdict(list)
    for lab, res, i in labelled:
        cat = rows[i]["row"].get(args.category_key)
        if cat is not None:
            cats[str(cat)].append((lab, res.outcome == "correct", compare[i] if compare is not None else None))
    if not cats:
        return
    say()
    say(f"  {'category':<22}{'rows':>6}{'megarl':>9}" + (f"{'math-verify':>13}" if compare else ""))
    for cat in sorted(cats):
        items = cats[cat]
        line = f"  {cat:<22}{len(items):>6}{100 * sum(lab == m for lab, m, _ in items) / len(items):>8.1f}%"
        seen = [(lab, c) for lab, _, c in items if c is not None]
        if seen:
            line += f"{100 * sum(lab == c for lab, c in seen) / len(seen):>12.1f}%"
        say(line)


def _reward_model_lines(say, flat, results) -> None:
    """Reward-model scores (mean, std), agreement with a rule in the same spec, pairwise accuracy on pairs."""
    scores = [x.model_score for _, x in flat if x.model_score is not None]
    if scores:
        mean = sum(scores) / len(scores)
        std = (sum((x - mean) ** 2 for x in scores) / len(scores)) ** 0.5
        say(f"reward model: {len(scores)} scores, mean {mean:.4f}, std {std:.4f}")
    agrees = [x.agrees for _, x in flat if x.agrees is not None]
    if agrees:
        say(f"reward model agrees with the rule verifier on {100 * sum(agrees) / len(agrees):.1f}% of "
            f"{len(agrees)} responses")
    pairs = [res for res in results if isinstance(res, tuple)]
    if pairs:
        wins = [c.score > r.score for c, r in pairs]
        margin = sum(c.score - r.score for c, r in pairs) / len(pairs)
        say(f"pairwise accuracy {100 * sum(wins) / len(pairs):.1f}% on {len(pairs)} chosen/rejected pairs (the "
            f"chosen response scores higher; mean margin {margin:.4f})")


def _latency(say, rows, flat, args) -> None:
    secs = sorted(x.seconds for _, x in flat)
    if not secs:
        return
    pick = lambda q: secs[min(len(secs) - 1, int(q * len(secs)))]
    say()
    say(f"latency: p50 {1000 * pick(0.5):.1f} ms, p90 {1000 * pick(0.9):.1f} ms, p99 {1000 * pick(0.99):.1f} ms, "
        f"max {1000 * secs[-1]:.1f} ms")
    say("slowest:")
    for i, x in sorted(flat, key=lambda item: -item[1].seconds)[: args.slowest]:
        say(f"  line {rows[i]['line']:>6}  {1000 * x.seconds:9.1f} ms  {x.outcome:<12}"
            f"{_short(rows[i]['row'].get(args.id_key, ''))}")


def _disagreements(say, rows, results, labels, args, compare) -> None:
    asked = [i for i in range(len(results)) if compare[i] is not None]
    diff = [i for i in asked if (results[i].score == 1.0) != compare[i]]
    say()
    say(f"disagreements with math-verify: {len(diff)} of {len(asked)} rows scored by the math verifier")
    for i in diff:
        say(f"  line {rows[i]['line']:>6}  megarl {results[i].outcome:<11} math-verify "
            f"{'correct' if compare[i] else 'not':<8} correct {labels[i]!s:<5} "
            f"answer {_short(rows[i]['row'][args.label_key])}  extracted {_short(results[i].extracted)}")


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
        obj["verifier"] = r["verifier"]
        if isinstance(res, tuple):  # a preference pair
            for side, x in zip(("chosen", "rejected"), res):
                obj.update({f"score_{side}": float(x.score), f"outcome_{side}": x.outcome,
                            f"normalized_{side}": x.normalized})
            obj.update(prefers_chosen=res[0].score > res[1].score, seconds=res[0].seconds + res[1].seconds)
        else:
            obj.update(score=float(res.score), outcome=res.outcome, extracted=res.extracted,
                       normalized=res.normalized, seconds=res.seconds)
            if res.model_score is not None:
                obj.update(model_score=res.model_score, agrees=res.agrees)
            if res.signals:
                obj["signals"] = res.signals
        if compare is not None and compare[i] is not None:
            obj["math_verify"] = compare[i]
        out.append(obj)
    out.extend(bad)
    out.sort(key=lambda o: o["line"])
    with open(path, "w", encoding="utf-8") as fh:
        for obj in out:
            fh.write(json.dumps(obj, ensure_ascii=False) + "\n")


def _import_plugins(argv: list[str] | None) -> None:
    """`--plugins` first: the verifiers they register may declare flags of their own, which the parser then knows."""
    from megarl.registry import load_plugins

    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--plugins", default="")
    known, _ = early.parse_known_args(argv)
    try:
        load_plugins(known.plugins)
    except ValueError as e:
        raise InputError(str(e)) from None


# The older spelling of an option -> today's (both are accepted, for scripts written against either).
_SPELLINGS = {"--default-verifier": "--verifier", "--gold-key": "--label-key", "--reward-workers": "--workers",
              "--reward-timeout": "--timeout"}


def check_spellings(argv: list[str]) -> None:
    """Two spellings of one option with different values (`--gold-key gold --label-key label`) is an error naming
    both: argparse would keep the last one in silence, and the rows would be scored against another field."""
    given: dict[str, dict[str, str]] = {}
    for i, tok in enumerate(argv):
        flag, eq, value = tok.partition("=")
        if flag in _SPELLINGS or flag in _SPELLINGS.values():
            if not eq:
                if i + 1 >= len(argv):
                    continue
                value = argv[i + 1]
            given.setdefault(_SPELLINGS.get(flag, flag), {}).setdefault(flag, value)
            if len(set(given[_SPELLINGS.get(flag, flag)].values())) > 1:
                both = " and ".join(f"{f} {v}" for f, v in given[_SPELLINGS.get(flag, flag)].items())
                older = next(f for f in given[_SPELLINGS.get(flag, flag)] if f in _SPELLINGS)
                raise InputError(f"{both} set one option to two values ({older} is the older spelling of "
                                 f"{_SPELLINGS[older]}); give it once")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_spellings(argv)
        _import_plugins(argv)
    except InputError as e:
        print(f"megarl-verify: error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        plugins = check_usage(args)
        rows, bad = read_rows(args.data, args)
        if args.compare and not any(r["verifier"] == "math" for r in rows):
            raise InputError("--compare math-verify compares math answers, but no row is scored by the math verifier")
        results = score_rows(rows, args, plugins) if rows else []
    except (InputError, ConfigError) as e:
        print(f"megarl-verify: error: {e}", file=sys.stderr)
        return 2
    compare = None
    if args.compare:
        compare = [mathverify_check(str(r["row"][args.response_key]), r["row"][args.label_key])
                   if r["verifier"] == "math" else None for r in rows]
    summarize(rows, results, args, compare)
    if args.audit:
        audit(rows, results, args.audit_examples)
    if bad:
        print(f"{len(bad)} bad line(s) skipped: {', '.join(str(b['line']) for b in bad[:20])}", file=sys.stderr)
    if args.output:
        write_output(args.output, rows, results, bad, args, compare)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
