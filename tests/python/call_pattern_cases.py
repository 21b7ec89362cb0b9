"""The cases of test_call_patterns.py (its docstring says what each is held to): training
loops drawn by hypothesis (derandomized, no example database), and the fixed issue-13 items.
A case is a dict: stage, precision, gas, steps, and per micro-step what each rank runs
(F(): a forward left unused; B(*losses, **flags): one engine.backward of their sum)."""
import os
import sys

from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_fuzz_training import drawn_cases, spread  # noqa: E402

N_CASES = 32
DRAWS = 300


# ---- the cases ----------------------------------------------------------------------
def F():
    return ["f"]


def B(*losses, **flags):
    return ["b", list(losses), flags]


@st.composite
def micro_steps(draw):
    """One micro-step's events: 1-3 backward calls, each of the sum of a non-empty set of the
    losses not yet backpropagated, after 0-2 new forwards; now and then a forward left
    unused at the end."""
    events, pending, n = [], [], 0
    for _ in range(draw(st.sampled_from([1, 1, 2, 2, 3]))):
        for _ in range(draw(st.integers(0 if pending else 1, 2))):
            events.append(F())
            pending.append(n)
            n += 1
        chosen = draw(st.lists(st.sampled_from(pending), min_size=1, max_size=len(pending), unique=True))
        pending = [k for k in pending if k not in chosen]
        flags = {}
        if draw(st.integers(0, 4)) == 0:
            flags["no_grad"] = True
        if draw(st.integers(0, 11)) == 0:
            flags["direct"] = True
        events.append(B(*sorted(chosen), **flags))
    if draw(st.integers(0, 9)) == 0:
        events.append(F())
    return {"events": events}


@st.composite
def cases(draw):
    gas, steps = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    case = {"stage": draw(st.integers(0, 3)), "precision": draw(st.sampled_from(["fp32", "bf16"])), "gas": gas,
            "seed": draw(st.integers(0, 2 ** 16)), "lr": draw(st.sampled_from([3e-3, 2e-2])),
            "clip": draw(st.sampled_from([0.05, 1.0])), "bucket": draw(st.sampled_from([16, 64, 5000])),
            "micro": [draw(micro_steps()) for _ in range(gas * steps)]}
    skip = draw(st.sampled_from([None] * 5 + ["all", 0, 1]))  # about one case in three misses a backward
    if skip is not None:
        index = draw(st.integers(0, gas * steps - 1))
        case["micro"][index]["skip"] = skip
        for micro in case["micro"][index - index % gas:][:gas]:  # that window's backwards: engine.backward
            for e in micro["events"]:
                if e[0] == "b":
                    e[2].pop("direct", None)
    return case


def draw_cases():
    """N_CASES drawn cases (DRAWS draws, derandomized, no example database), spread over
    (stage, precision, accumulation, whether a micro-step misses its backward)."""
    return spread(drawn_cases(cases(), DRAWS), N_CASES, lambda c: (c["stage"], c["precision"], c["gas"],
                                             any(m.get("skip") is not None for m in c["micro"])))


def item_cases():
    """(item, case) for issue 13's items 2, 3, 8, 9 and 10, and the direct second backward."""
    out = []

    def add(item, stage, precision="fp32", gas=1, seed=11, **kw):
        out.append((item, dict(stage=stage, precision=precision, gas=gas, seed=seed, **kw)))

    one = [F(), B(0)]
    for s in range(4):
        # 2: a window trains, then requires_grad changes before the next backward or step.
        for at in ("backward", "step"):
            add("2", s, gas=1, micro=[{"events": one}, {"events": one}],
                change={"micro": 1, "at": at, "param": "inp.weight", "to": False})
            add("2", s, precision="bf16", gas=2, frozen=["inp.bias"], micro=[{"events": one}] * 4,
                change={"micro": 3, "at": at, "param": "inp.bias", "to": True})
        # 3: no backward on any rank; a forward may have run. Then a normal window.
        add("3", s, gas=1, micro=[{"events": one, "skip": "all"}, {"events": one}])
        add("3", s, precision="bf16", gas=2, micro=[{"events": [F()], "skip": "all"}, {"events": one},
                                                    {"events": one}, {"events": one}])
        add("3", s, gas=2, micro=[{"events": [], "skip": "all"}, {"events": [], "skip": "all"},
                                  {"events": one}, {"events": one}])
        # 9: one rank skips, at the window's last or first micro-step.
        add("9", s, gas=1, micro=[{"events": one, "skip": 1}, {"events": one}])
        add("9", s, precision="bf16", gas=2, micro=[{"events": [F(), F(), B(0, 1)]},
                                                    {"events": [F(), F(), B(0, 1)], "skip": 0}, {"events": one},
                                                    {"events": one}])
        add("9", s, gas=2, micro=[{"events": one, "skip": 1}, {"events": one}, {"events": one}, {"events": one}])
        # ... while the other rank runs two passes there (stages 0-2: a collision).
        add("9", s, gas=1, micro=[{"events": [F(), B(0), F(), B(1)], "skip": 1}, {"events": one}])
        # 10: backward under torch.no_grad().
        add("10", s, micro=[{"events": [F(), B(0, no_grad=True)]}, {"events": [F(), F(), B(1, no_grad=True),
                                                                                 B(0, no_grad=True)]}])
        add("10", s, precision="bf16", gas=2, micro=[{"events": [F(), B(0, no_grad=True)]}] * 4)
        # A direct loss.backward(): first in its micro-step, after an engine.backward(), or in
        # a micro-step that does not reduce.
        add("direct", s, micro=[{"events": [F(), B(0, direct=True), F(), B(1)]}, {"events": one}])
        add("direct", s, micro=[{"events": [F(), B(0), F(), B(1, direct=True)]}, {"events": one}])
        add("direct", s, gas=2, micro=[{"events": [F(), B(0), F(), B(1, direct=True)]}, {"events": one},
                                       {"events": one}, {"events": one}])
        # 8: rank r's batches go through expert r.
        for precision in ("fp32", "bf16"):
            add("8", s, precision=precision, moe=True, prefetch=0, micro=[{"events": [F(), F(), B(0, 1)]}] * 2)
        add("8", s, gas=2, moe=True, micro=[{"events": one}] * 4)
    return out


def all_cases():
    drawn = draw_cases()
    items = item_cases()
    cases = drawn + [c for _, c in items]
    for i, case in enumerate(cases):
        case["id"] = i
    return drawn, items, cases
