#!/bin/bash
# Hierarchical vs flat collectives between two real network stacks: two network
# namespaces joined by a veth pair capped with tc tbf, two ranks in each (root needed).
#   sudo benchmarks/netns_hierarchy.sh [RATE] [SIZES]      # e.g. 1gbit 64K,1M,16M
set -euo pipefail
RATE=${1:-1gbit}
SIZES=${2:-64K,1M,16M}
PY=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
HERE=$(cd "$(dirname "$0")/.." && pwd)
T=hb$$
A=${T}a; B=${T}b
cleanup() { ip netns del $A 2>/dev/null || true; ip netns del $B 2>/dev/null || true; }
trap cleanup EXIT
ip netns add $A; ip netns add $B
ip link add ${T}va type veth peer name ${T}vb
ip link set ${T}va netns $A; ip link set ${T}vb netns $B
ip -n $A addr add 10.231.7.1/24 dev ${T}va; ip -n $B addr add 10.231.7.2/24 dev ${T}vb
for ns in $A $B; do ip -n $ns link set lo up; done
ip -n $A link set ${T}va up; ip -n $B link set ${T}vb up
ip netns exec $A tc qdisc add dev ${T}va root tbf rate $RATE burst 256kb latency 100ms
ip netns exec $B tc qdisc add dev ${T}vb root tbf rate $RATE burst 256kb latency 100ms
echo "two namespaces, veth capped at $RATE each way, 2 ranks in each"
for mode in auto tcp; do
  PORT=$((20000 + RANDOM % 20000))
  for node in 0 1; do
    ns=$A; [ $node = 1 ] && ns=$B
    ip netns exec $ns env ACCORD_TRANSPORT=$mode PYTHONPATH="$HERE" "$PY" -m accord run \
      --nnodes 2 --node-rank $node --master-addr 10.231.7.1 --master-port $PORT -n 2 \
      "$HERE/benchmarks/bench_hierarchy.py" --sizes "$SIZES" --blocks 5 &
  done
  wait
done
