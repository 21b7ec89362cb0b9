#!/usr/bin/env bash
# Two hosts on this machine: two network namespaces joined by a veth pair (10.233.0.1 and
# 10.233.0.2, with addresses of their own; nothing leaves the machine), each with its own
# hostname, removed on exit even after a failure. Runs COMMAND as a 2 x PER_HOST job (PER_HOST
# ranks per host, 2 by default: W = 4) under either launcher:
#
#   scripts/two_hosts.sh torchrun COMMAND...   torchrun --nnodes 2 --node_rank 0|1 in each host,
#                                              MASTER_ADDR on host 0, gloo over the veth
#   scripts/two_hosts.sh mpirun COMMAND...     mpirun --host h0:2,h1:2 from host 0, with an rsh
#                                              agent that starts Open MPI's daemon inside host 1
#
# COMMAND is a Python script and its arguments (run with $PY, default .venv/bin/python).
# RATE (e.g. RATE=1gbit) shapes the link with tc at both ends (a token bucket each way); unset,
# the veth runs as fast as the machine moves bytes.
# Exit status: the job's; 77 (with the reason on stdout) when namespaces cannot be made here.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
launcher=${1:?usage: two_hosts.sh torchrun|mpirun COMMAND...}
per_host=${PER_HOST:-2}
[[ $per_host =~ ^[1-9][0-9]*$ ]] || { echo "two_hosts.sh: PER_HOST must be a positive count, got '$per_host'" >&2; exit 2; }
shift
[[ $# -gt 0 ]] || { echo "usage: two_hosts.sh torchrun|mpirun COMMAND..." >&2; exit 2; }

if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null || ! command -v unshare >/dev/null; then
  echo "SKIP: two_hosts.sh needs root, ip (iproute2) and unshare (util-linux) to make network namespaces"
  exit 77
fi
# Namespaces of an earlier run whose script is gone (killed before its trap ran).
for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^zt[0-9]+h[01]$'); do
  owner=${n#zt}
  owner=${owner%h?}
  kill -0 "$owner" 2>/dev/null || ip netns del "$n" 2>/dev/null
done
tag=$$
ns=(zt${tag}h0 zt${tag}h1)
addr=(10.233.0.1 10.233.0.2)
dev=(zt${tag}a zt${tag}b)
cleanup() { for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null; done; rm -rf "$work"; }
work=$(mktemp -d)
trap cleanup EXIT
for n in "${ns[@]}"; do
  ip netns add "$n" || { echo "SKIP: cannot create network namespaces here (ip netns add failed)"; exit 77; }
  ip -n "$n" link set lo up
done
ip link add "${dev[0]}" type veth peer name "${dev[1]}" || { echo "SKIP: cannot create a veth pair here"; exit 77; }
for i in 0 1; do
  ip link set "${dev[$i]}" netns "${ns[$i]}"
  ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "${dev[$i]}"
  ip -n "${ns[$i]}" link set "${dev[$i]}" up
  if [[ -n ${RATE:-} ]]; then  # both ends: each direction is one end's egress
    ip netns exec "${ns[$i]}" tc qdisc add dev "${dev[$i]}" root tbf rate "$RATE" burst 256kb latency 100ms ||
      { echo "two_hosts.sh: cannot shape ${dev[$i]} to RATE=$RATE with tc" >&2; exit 2; }
  fi
done

# Runs "$@" inside host i, with that host's name (a UTS namespace of its own).
in_host() {
  local i=$1
  shift
  ip netns exec "${ns[$i]}" unshare --uts bash -c 'hostname "$0"; exec "$@"' "zt-host$i" "$@"
}

common_env=(OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1)
case "$launcher" in
  torchrun)
    port=29517
    pids=()
    for i in 0 1; do
      in_host "$i" env "${common_env[@]}" GLOO_SOCKET_IFNAME="${dev[$i]}" ZERORT_TEST_HOST="$i" \
        "$PY" -m torch.distributed.run --nnodes 2 --nproc_per_node "$per_host" --node_rank "$i" \
        --master_addr "${addr[0]}" --master_port "$port" "$@" > "$work/host$i.log" 2>&1 &
      pids+=($!)
    done
    rc=0
    for i in 0 1; do
      wait "${pids[$i]}" || rc=$?
    done
    for i in 0 1; do sed "s/^/[host $i] /" "$work/host$i.log"; done
    exit "$rc"
    ;;
  mpirun)
    # The rsh agent: Open MPI calls it as `agent HOST COMMAND...` to start its daemon on a host.
    agent=$work/agent.sh
    cat > "$agent" <<AGENT
#!/usr/bin/env bash
host=\$1
shift
case "\$host" in
  ${addr[0]}) i=0 ;;
  ${addr[1]}) i=1 ;;
  *) echo "two_hosts agent: unknown host \$host" >&2; exit 1 ;;
esac
ns=(${ns[*]})
exec ip netns exec "\${ns[\$i]}" unshare --uts bash -c 'hostname "\$0"; exec bash -c "\$*"' "zt-host\$i" "\$@"
AGENT
    chmod +x "$agent"
    in_host 0 env "${common_env[@]}" mpirun --host "${addr[0]}:$per_host,${addr[1]}:$per_host" -np $((2 * per_host)) \
      --mca plm_rsh_agent "$agent" --mca oob_tcp_if_include 10.233.0.0/24 --mca btl tcp,self \
      --mca btl_tcp_if_include 10.233.0.0/24 -x OMP_NUM_THREADS -x PYTHONUNBUFFERED -x PATH \
      "$PY" "$@"
    ;;
  *)
    echo "two_hosts.sh: unknown launcher '$launcher'; use torchrun or mpirun" >&2
    exit 2
    ;;
esac
