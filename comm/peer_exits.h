// PeerExits: the peer ranks this process has been told have exited (by the launcher's
// store under torchrun, or by a peer's goodbye message under mpirun), process-wide. A
// collective that such a peer can never join fails at once, naming the peer, instead of at
// comm.timeout_s (Work::wait asks while it waits).
#pragma once

#include <string>

namespace zerort {

// rank: the peer's rank in the launch (the world); how: what is known, e.g. "exited normally".
void note_peer_exit(int rank, const std::string& how);

// "rank 1 exited normally" for the peers noted at least `settled_ms` ago ("" when none):
// a peer that just finished the collective this rank waits for and then exited has sent
// everything already, so its bytes get that long to arrive first.
std::string peer_exits(long settled_ms);

// The message of a collective `call` that cannot finish because of the exits in `gone`.
std::string peer_exit_message(const std::string& call, const std::string& gone);

void clear_peer_exits();  // tests

}  // namespace zerort
