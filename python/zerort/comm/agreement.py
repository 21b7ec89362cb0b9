"""Whether every rank holds the same bytes, in one small all-gather, and if not what each
holds: the check behind the one-model check at initialize (zerort.engine.same_model) and
the checkpoint's agreement on tags and outcomes (zerort.state.checkpoint)."""
import hashlib

import torch

DIGEST_WORDS = 4  # int64 words of the SHA-256, plus the entry count


def _digest(data):
    h = hashlib.sha256(data).digest()
    words = [int.from_bytes(h[8 * i:8 * i + 8], "little", signed=True) for i in range(DIGEST_WORDS)]
    return torch.tensor(words + [len(data)], dtype=torch.int64)


def _gather_bytes(comm, data):
    """Every rank's bytes, as a list indexed by rank (two all-gathers: lengths, padded data)."""
    w = comm.size
    n = torch.tensor([len(data)], dtype=torch.int64)
    lens = comm.all_gather(n, torch.empty(w, dtype=torch.int64))
    words = (int(lens.max()) + 7) // 8
    mine = torch.zeros(words * 8, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    out = comm.all_gather(mine.view(torch.int64), torch.empty(w * words, dtype=torch.int64))
    raw = out.view(torch.uint8).view(w, words * 8)
    return [bytes(raw[r, :int(lens[r])].tolist()) for r in range(w)]


def gather_if_different(comm, data):
    """None when every rank holds the same bytes (one all-gather of a 5-word digest);
    otherwise every rank's bytes, indexed by rank. A collective: every rank gets the same
    answer."""
    if comm.size == 1:
        return None
    digest = _digest(data)
    everyone = comm.all_gather(digest, torch.empty(comm.size * digest.numel(), dtype=torch.int64))
    everyone = everyone.view(comm.size, -1)
    if bool((everyone == everyone[0]).all()):
        return None
    return _gather_bytes(comm, data)


def ranks_text(rs):
    """"rank 3" or "ranks 0, 2": for messages that name ranks."""
    rs = list(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))
