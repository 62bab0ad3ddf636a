"""The synthetic arithmetic task of the CPU demo: `a+b=` and `a-b=` with small operands.

Operands run over 0..50 and every answer is non-negative, which gives 2,601 additions and 1,326 subtractions:
3,927 distinct problems. A seeded split sets 200 of them aside; they are never trained on, so held-out accuracy
measures what the model computes rather than what it memorised.

Pure python on purpose: the data pipeline and tests import this without torch. The one heavy helper,
`build_tokenizer`, imports `tokenizers`/`transformers` inside the function.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

MAX_OPERAND = 50
NUM_HELDOUT = 200
VERIFIER = "arithmetic"

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Everything the task and short free-text prompts need: 77 characters + 2 specials = 79 ids, padded to 80 in the
# model (a multiple of 16).
TOKENIZER_CHARS = "0123456789+-= \n" + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + ".,:;!?()*/"


@dataclass(frozen=True)
class Problem:
    id: str  # "add-12-7": stable across runs, so rows can be joined with logs
    prompt: str  # "12+7="
    answer: str  # "19"
    verifier: str = VERIFIER


def all_problems(max_operand: int = MAX_OPERAND) -> list[Problem]:
    """Every problem, in a fixed order: all additions, then the subtractions with a non-negative answer."""
    ops = range(max_operand + 1)
    adds = [Problem(f"add-{a}-{b}", f"{a}+{b}=", str(a + b)) for a in ops for b in ops]
    subs = [Problem(f"sub-{a}-{b}", f"{a}-{b}=", str(a - b)) for a in ops for b in ops if a >= b]
    return adds + subs


def split_problems(
    problems: list[Problem] | None = None, num_heldout: int = NUM_HELDOUT, seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """Return (train, heldout): a seeded, order-independent choice of `num_heldout` problems set aside.

    The choice depends only on the seed and the set of ids, so shuffling the input cannot move a problem from
    held-out into training between runs.
    """
    problems = all_problems() if problems is None else problems
    ids = sorted(p.id for p in problems)
    if num_heldout > len(ids):
        raise ValueError(f"num_heldout={num_heldout} exceeds the {len(ids)} problems available")
    heldout_ids = set(random.Random(seed).sample(ids, num_heldout))
    train = [p for p in problems if p.id not in heldout_ids]
    heldout = [p for p in problems if p.id in heldout_ids]
    return train, heldout


def write_jsonl(path: str | Path, problems: Iterable[Problem]) -> int:
    """Write one `{"id", "prompt", "answer", "verifier"}` row per problem (every field of any task's row
    dataclass); return the row count."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps(asdict(p)) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path, row_type: type = Problem) -> list:
    """The rows of a task's jsonl file as `row_type` (this task's `Problem`, or another task's row dataclass)."""
    with open(path, encoding="utf-8") as f:
        return [row_type(**json.loads(line)) for line in f if line.strip()]


def build_tokenizer(out_dir: str | Path | None = None, chars: str = TOKENIZER_CHARS):
    """A character-level tokenizer, built as byte-level BPE with no merges; saved to `out_dir` when given.

    Why byte-level BPE rather than a plain character vocabulary: with transformers 5.x, `AutoTokenizer` on a
    checkpoint whose config says `model_type: qwen2` ignores a saved custom pre-tokenizer and rebuilds a
    `Qwen2Tokenizer` from vocab + merges; a character-level tokenizer then silently loses spaces and newlines.
    A byte-level BPE whose vocabulary is the wanted characters (in byte-level spelling, e.g. space = "Ġ") and
    whose merge list is empty loads identically through both paths. Characters outside `chars` are dropped.

    Ids: 0 = `<|endoftext|>` (eos; no bos is used), 1 = `<|pad|>`, then `chars` in order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_spelling = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for raw bytes
    to_byte_level = _bytes_to_unicode()
    if len(set(chars)) != len(chars) or any(len(c.encode("utf-8")) != 1 for c in chars):
        raise ValueError("tokenizer chars must be distinct single-byte characters")
    vocab = {EOS_TOKEN: 0, PAD_TOKEN: 1}
    for c in chars:
        spelled = to_byte_level[ord(c)]
        assert spelled in byte_spelling
        vocab[spelled] = len(vocab)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: with no merges the GPT-2 word split changes nothing, so skip it.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, clean_up_tokenization_spaces=False
    )
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the spelling byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}
