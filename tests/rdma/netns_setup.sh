#!/usr/bin/env bash
# Inside the Soft-RoCE VM only (called by vm_guest.sh). Builds two "remote" memory-server
# hosts for tests/rdma/test_netns.py:
#
#   network namespaces smb-a / smb-b: the servers' gRPC and TCP listeners
#       na0 198.19.1.1 (initial ns) <-> na1 198.19.1.2 (smb-a)
#       nb0 198.19.2.1 (initial ns) <-> nb1 198.19.2.2 (smb-b)
#   one RDMA fabric: a bridge with three veth-backed rxe devices
#       rxec on c0 198.19.0.1 (client), rxea on a0 198.19.0.2 (server a), rxeb on b0 198.19.0.3 (server b)
#
# rxe on kernel 6.1 sends and receives only in the initial namespace, so the rxe netdevs
# stay there (the servers in smb-a/smb-b still open their device: RDMA devices are shared
# across namespaces). Packets between two local addresses would short-cut through lo
# (and reach the wrong rxe device), so each rxe netdev routes through its own table
# (`ip rule oif`) onto the wire, and accepts local source addresses.
set -euo pipefail
sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
sysctl -qw net.ipv4.conf.all.accept_local=1 net.ipv4.conf.default.accept_local=1
sysctl -qw net.ipv4.conf.all.arp_ignore=1
ip link add br-rdma type bridge
ip link set br-rdma up
table=100
for spec in c:198.19.0.1:rxec a:198.19.0.2:rxea b:198.19.0.3:rxeb; do
  IFS=: read -r n ip dev <<<"$spec"
  ip link add ${n}0 type veth peer name ${n}1
  ip link set ${n}1 master br-rdma
  ip link set ${n}1 up
  sysctl -qw net.ipv4.conf.${n}0.rp_filter=0 net.ipv4.conf.${n}0.accept_local=1
  ip addr add $ip/24 dev ${n}0
  ip link set ${n}0 up
  ip route add 198.19.0.0/24 dev ${n}0 src $ip table $table
  ip rule add pref 10 oif ${n}0 lookup $table
  table=$((table + 1))
  rdma link add $dev type rxe netdev ${n}0
done
ip rule add pref 100 lookup local
ip rule del pref 0 lookup local
# static neighbours: every rxe netdev knows the others' MACs
for x in c a b; do for y in c a b; do
  [ $x = $y ] && continue
  case $y in c) yip=198.19.0.1;; a) yip=198.19.0.2;; b) yip=198.19.0.3;; esac
  ip neigh replace $yip lladdr "$(cat /sys/class/net/${y}0/address)" dev ${x}0 nud permanent
done; done
for n in a b; do
  ns=smb-$n; i=$([ $n = a ] && echo 1 || echo 2)
  ip netns add $ns
  ip link add n${n}0 type veth peer name n${n}1
  ip link set n${n}1 netns $ns
  ip addr add 198.19.$i.1/24 dev n${n}0
  ip link set n${n}0 up
  ip -n $ns addr add 198.19.$i.2/24 dev n${n}1
  ip -n $ns link set n${n}1 up
  ip -n $ns link set lo up
done
echo "netns_setup: rxec/rxea/rxeb on 198.19.0.1-3, namespaces smb-a (198.19.1.2) smb-b (198.19.2.2)"
