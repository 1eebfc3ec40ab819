"""nf4deq's pattern matcher against Python's re, question by question.

PEFT picks an adapter's rank_pattern / alpha_pattern entry for a module with
re.match(rf"(.*\\.)?({key})$", module). nf4deq answers the same question in C
(src/pattern.c, through build/tools/pattern_match). This asks both about
hand-picked cases and about seeded random patterns and names, and fails on
any difference:
  - where Python finds a match or not, nf4deq must say the same, or refuse the
    pattern for a feature it does not support (back-references, look-around,
    named groups, ...; the reason says "not supported") or for its size;
  - where Python refuses the pattern, nf4deq must refuse it too.

  python3 check_patterns.py BUILD_DIR [CASES]
"""
import random
import re
import signal
import subprocess
import sys
import warnings

warnings.simplefilter("ignore")  # FutureWarning on "[[" and the like

PEFT = r"(.*\.)?({})$"

# (key, module) as an adapter config would hold them, wrapped as PEFT wraps them.
PEFT_CASES = [
    ("q_proj", "model.layers.0.self_attn.q_proj"),
    ("q_proj", "model.layers.0.self_attn.xq_proj"),
    ("q_proj", "q_proj"),
    ("layers.0.self_attn.q_proj", "base_model.model.model.layers.0.self_attn.q_proj"),
    (r"layers\.[0-9]+\.mlp\..*", "model.layers.12.mlp.up_proj"),
    (r"layers\.\d+\.mlp\.(up|down)_proj", "model.layers.7.mlp.down_proj"),
    (r"layers\.\d+\.mlp\.(up|down)_proj", "model.layers.7.mlp.gate_proj"),
    (r".*\.(?:q|k|v)_proj", "model.layers.3.self_attn.k_proj"),
    (r"layers\.(1[0-9]|2[0-3])\.", "model.layers.15.mlp"),
    (r"model\.layers\.(1[0-9]|2[0-3])\..*", "model.layers.15.mlp.up_proj"),
    (r"model\.layers\.(1[0-9]|2[0-3])\..*", "model.layers.25.mlp.up_proj"),
    ("proj", "model.layers.0.self_attn.q_proj"),
    ("^model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj"),
    ("^layers.0.q_proj", "model.layers.0.q_proj"),
    ("q_proj$", "model.q_proj"),
    (r"q_proj\Z", "model.q_proj"),
    (r"\bq_proj", "model.q_proj"),
    (r"\Bq_proj", "model.q_proj"),
    ("a)|(b", "x.b"),
    ("a)|(b", "a"),
    ("layers.[0-9]{1,2}.q_proj", "model.layers.31.q_proj"),
    ("layers.[0-9]{1,2}.q_proj", "model.layers.310.q_proj"),
    ("(", "x"),
    ("q_proj\n", "model.q_proj\n"),
    # regcomp(3) takes seconds or minutes on these; Python's backtracking is
    # quick only where the match is found early, as here.
    ("((.*)*){1,250}", "model.layers.0.mlp"),
    ("(.*){1,333}x", "model.layers.0.x"),
    ("a{3000}", "a"),
    (r"(?!vision).*q_proj", "model.q_proj"),
    (r"(?P<l>\d+)\.q_proj", "model.1.q_proj"),
    (r"(\d)\1", "model.11"),
    ("é.q_proj", "model.é.q_proj"),
    (".\u00e9", "x.a\u00e9"),
    ("[^a]", "\u20ac"),
    (r"\s", "\u3000"),
    ("[]a]", "x.]"),
    ("[^]a]", "x.b"),
    (r"[\]]", "x.]"),
    ("[a-]", "x.-"),
    (r"[\d-]", "x.-"),
    (r"[\d-z]", "x.z"),
    (r"[z-a]", "x.z"),
    (r"\x41\u0042\U00000043", "x.ABC"),
    (r"\01\012", "x.\1\n"),
    (r"\101", "x.A"),
    (r"[\101]", "x.A"),
    (r"[\1]", "x.\1"),
    (r"\8", "x.8"),
    (r"\q", "x.q"),
    (r"\.", "x.."),
    ("a{,3}", "x.aa"),
    ("a{2,}", "x.aaa"),
    ("a{,}", "x.aaa"),
    ("a{}", "x.a{}"),
    ("a{x}", "x.a{x}"),
    ("a{3,2}", "x.aaa"),
    ("{3}", "x.a"),
    ("x{", "x.x{"),
    ("a**", "x.a"),
    ("a*?", "x.aa"),
    ("a*??", "x.aa"),
    ("a*+", "x.aa"),
    ("a{2}{3}", "x.aaaaaa"),
    ("^*", "x"),
    ("(^)*a", "x.a"),
    ("(?:)*a", "x.a"),
    ("(?:)", "x.a"),
    ("()", "x."),
    ("|", "x."),
    ("a||b", "x.b"),
    ("(?i)q_proj", "model.Q_PROJ"),
    (r"\N{LATIN SMALL LETTER E WITH ACUTE}", "x.\u00e9"),
    ("a)", "x.a"),
    ("\\", "x"),
    ("[a", "x"),
    ("(?#c)a", "x.a"),
    ("(?>a)", "x.a"),
    (r"a{4294967295}", "x"),
    (r"a{99999999999999999999}", "x"),
    ("(" * 120 + ")" * 120, "x."),
]

LETTERS = "ab_.01"
ASCII_NAME_CHARS = "ab_.01 A\n"
NAME_CHARS = ASCII_NAME_CHARS + "\u00e9\u20ac"


def rand_set(r):
    parts = []
    if r.random() < 0.3:
        parts.append("^")
    for _ in range(r.randint(1, 3)):
        k = r.random()
        if k < 0.2:
            parts.append(r.choice([r"\d", r"\w", r"\s", r"\D", r"\W", r"\S"]))
        elif k < 0.45:
            lo, hi = sorted(r.sample("ab_.01A", 2))
            parts.append(lo + "-" + hi)
        elif k < 0.55:
            parts.append(r.choice([r"\.", r"\]", r"\\", r"\-", r"\n", r"\x61", r"\b"]))
        else:
            parts.append(r.choice(LETTERS + "-"))
    return "[" + "".join(parts) + "]"


def rand_atom(r, depth):
    k = r.random()
    if k < 0.35:
        return r.choice(LETTERS.replace(".", r"\."))
    if k < 0.45:
        return "."
    if k < 0.55:
        return rand_set(r)
    if k < 0.65:
        return r.choice([r"\d", r"\w", r"\s", r"\D", r"\W", r"\S", r"\b", r"\B", r"\A", r"\Z", r"\x61", r"\0"])
    if k < 0.72:
        return r.choice("^$")
    if depth < 3:
        return r.choice(["(", "(?:"]) + rand_alt(r, depth + 1) + ")"
    return r.choice(LETTERS)


def rand_repeat(r):
    k = r.random()
    if k < 0.5:
        q = r.choice("*+?")
    else:
        m = r.randint(0, 3)
        n = m + r.randint(0, 3)
        q = r.choice(["{%d}" % m, "{%d,}" % m, "{,%d}" % n, "{%d,%d}" % (m, n)])
    return q + ("?" if r.random() < 0.2 else "")


def rand_seq(r, depth):
    out = []
    for _ in range(r.randint(0, 4)):
        a = rand_atom(r, depth)
        if a not in ("^", "$", r"\b", r"\B", r"\A", r"\Z") and r.random() < 0.4:
            a += rand_repeat(r)
        out.append(a)
    return "".join(out)


def rand_alt(r, depth):
    return "|".join(rand_seq(r, depth) for _ in range(r.randint(1, 3)))


def rand_name(r):
    chars = NAME_CHARS if r.random() < 0.25 else ASCII_NAME_CHARS
    return "".join(r.choice(chars) for _ in range(r.randint(0, 8)))


def garbage(r):
    return "".join(r.choice(r"()[]{}|*+?^$\.-,:!=<>P0123abdswDWSbBAZxuUN") for _ in range(r.randint(0, 10)))


class Backtracking(Exception):
    pass


def stop_backtracking(*_):
    raise Backtracking()


# nf4deq reads \d and \w (so \b) as ASCII; Python as Unicode. Module names are ASCII.
UNICODE_CLASSES = re.compile(r"\\[dDwWbB]")
# Python 3.14 lets \B match an empty string; before, neither \b nor \B did, as
# in nf4deq. Module names are never empty.
NEW_EMPTY_B = sys.version_info >= (3, 14)


def python_answer(pattern, name):
    """'1', '0', 'E' (refused), or 'T' where Python's backtracking ran past
    half a second (random patterns can make it exponential); re polls signals."""
    try:
        rx = re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as e:
        return "E", str(e)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        return ("1" if rx.match(name) else "0"), ""
    except Backtracking:
        return "T", ""
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main():
    build = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 12000
    r = random.Random(20261123)
    cases = [(PEFT.format(k), m) for k, m in PEFT_CASES]
    cases += [(rand_alt(r, 0), rand_name(r)) for _ in range(count)]
    cases += [(PEFT.format(rand_alt(r, 0)), "model." + rand_name(r)) for _ in range(count // 4)]
    cases += [(garbage(r), rand_name(r)) for _ in range(count // 2)]
    blob = b"".join(p.encode() + b"\0" + n.encode() + b"\0" for p, n in cases)
    done = subprocess.run([f"{build}/tools/pattern_match"], input=blob, capture_output=True, check=True)
    answers = done.stdout.decode().splitlines()
    assert len(answers) == len(cases), f"{len(answers)} answers to {len(cases)} questions"
    signal.signal(signal.SIGALRM, stop_backtracking)
    bad = []
    refused = slow = unicode = 0
    for (pattern, name), ours in zip(cases, answers):
        want, why = python_answer(pattern, name)
        if want != "E" and NEW_EMPTY_B and not name and "\\B" in pattern:
            continue
        if want == "T" or (not name.isascii() and UNICODE_CLASSES.search(pattern) and want != "E"):
            slow += want == "T"
            unicode += want != "T"
            continue
        if want == "E":
            ok = ours.startswith("E ")
        elif ours.startswith("E "):
            refused += 1
            ok = "not supported" in ours or "expand past" in ours or "nest more than" in ours
        else:
            ok = ours == want
        if not ok:
            bad.append(f"  {pattern!r} on {name!r}: Python {want} {why}, nf4deq {ours}")
    if bad:
        print(f"check_patterns: {len(bad)} of {len(cases)} answers differ from Python's re:", file=sys.stderr)
        print("\n".join(bad[:40]), file=sys.stderr)
        return 1
    print(f"patterns: {len(cases)} questions, answers equal to Python {sys.version.split()[0]}'s re "
          f"({refused} refused as unsupported or too large; not compared: {unicode} with \\d or \\w on "
          f"a non-ASCII name, {slow} where Python backtracked past 0.5 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
