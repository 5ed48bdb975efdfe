#!/usr/bin/env bash
# Everything `docker compose up` needs on a bare machine of this project's kind (Debian
# bookworm, root, no Docker engine running, no image registry reachable), each step skipped
# when already done, each timed:
#
#   1. docker.io, docker-compose, mmdebstrap and eatmydata from Debian's packages, if missing;
#   2. dockerd, if none answers on DOCKER_HOST (default unix:///var/run/docker.sock);
#   3. the base image: python:3.11-slim where a registry is reachable; else Debian bookworm
#      bootstrapped from Debian's mirror (minbase + python3, python3-venv, libnuma1,
#      libgomp1; no docs, man pages or locales) and `docker import`ed, its tarball cached in
#      $KVSTORE_COMPOSE_CACHE (~/.cache/kvstore-compose); meanwhile, the wheelhouse
#      (scripts/compose/wheelhouse.py: the venv's own versions);
#   4. the images kvstore-store, kvstore-engine and, without a registry, kvstore-redis
#      (Dockerfile targets), then their sizes.
#
# usage: scripts/compose/prepare.sh VENV_PYTHON
# Writes $KVSTORE_COMPOSE_CACHE/env: BASE_IMAGE and REDIS_IMAGE for the test.
set -euo pipefail
py=${1:?usage: $0 VENV_PYTHON}
root=$(cd "$(dirname "$0")/../.." && pwd)
cache=${KVSTORE_COMPOSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore-compose}
mkdir -p "$cache"
t0=$SECONDS
step() { printf '[compose %4ds] %s\n' $((SECONDS - t0)) "$*"; }

# The Debian docker.io client builds with BuildKit by itself (the Dockerfile needs RUN
# --mount); a newer client elsewhere on PATH may lack its buildx plugin.
docker_cli() { if [ -x /usr/bin/docker ]; then /usr/bin/docker "$@"; else docker "$@"; fi; }

install_packages() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  command -v eatmydata >/dev/null || missing+=(eatmydata)
  [ ${#missing[@]} -eq 0 ] && return
  step "apt-get install ${missing[*]}"
  [ "$(id -u)" = 0 ] || { echo "error: installing ${missing[*]} needs root" >&2; exit 1; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Started here: no default bridge and no iptables rules (this machine's traffic stays on
# loopback: the test runs every container on the host network, builds too).
start_dockerd() {
  docker_cli info >/dev/null 2>&1 && return
  local sock=${DOCKER_HOST:-unix:///var/run/docker.sock}
  step "starting dockerd on $sock (log $cache/dockerd.log)"
  nohup dockerd -H "$sock" --bridge=none --iptables=false --ip-masq=false \
    >"$cache/dockerd.log" 2>&1 &
  for _ in $(seq 120); do docker_cli info >/dev/null 2>&1 && return; sleep 0.5; done
  echo "error: dockerd did not answer within 60 s; see $cache/dockerd.log" >&2; exit 1
}

# mmdebstrap, not debootstrap: the same minbase from the same mirror, but apt downloads in
# parallel and eatmydata spares dpkg its fsyncs: 30 s instead of 70 s here.
DEBIAN_PACKAGES=python3,python3-venv,libnuma1,libgomp1
base_image() {
  if timeout 60 docker_cli pull -q python:3.11-slim >/dev/null 2>&1 \
     && timeout 60 docker_cli pull -q redis:7 >/dev/null 2>&1; then
    BASE_IMAGE=python:3.11-slim REDIS_IMAGE=redis:7; return
  fi
  local tag; tag=bookworm-$(printf '%s' "$DEBIAN_PACKAGES" | sha256sum | cut -c1-12)
  BASE_IMAGE=kvstore-base:$tag REDIS_IMAGE=kvstore-redis
  docker_cli image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return
  local tarball=$cache/$tag.tar
  if [ ! -s "$tarball" ]; then
    step "no image registry: Debian bookworm minbase + $DEBIAN_PACKAGES (mmdebstrap)"
    bootstrap "$tarball.tmp" >"$cache/mmdebstrap.log" 2>&1 \
      || { tail -20 "$cache/mmdebstrap.log" >&2; echo "error: mmdebstrap failed; see $cache/mmdebstrap.log" >&2; exit 1; }
    mv "$tarball.tmp" "$tarball"
  fi
  step "docker import $tarball as $BASE_IMAGE"
  docker_cli import -c 'CMD ["bash"]' "$tarball" "$BASE_IMAGE" >/dev/null
}

# What python:3.11-slim and Debian's own images leave out, now and for the Dockerfile's
# later apt-get installs: recommended packages, docs (but copyrights), man pages, locales,
# package lists and caches.  usr-is-merged, not usrmerge (which pulls in perl).
bootstrap() {
  local hooks=/usr/share/mmdebstrap/hooks
  mmdebstrap --variant=minbase --include="$DEBIAN_PACKAGES" --format=tar \
    --hook-dir="$hooks/merged-usr" --hook-dir="$hooks/eatmydata" \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --customize-hook='printf "%s\n" "DPkg::Post-Invoke { \"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true\"; };" "Dir::Cache::pkgcache \"\"; Dir::Cache::srcpkgcache \"\";" > "$1/etc/apt/apt.conf.d/docker-clean"; rm -f "$1"/var/cache/apt/*.bin' \
    bookworm "$1" http://deb.debian.org/debian
}

build() {  # build TARGET: the image kvstore-TARGET from the Dockerfile's stage TARGET
  local log=$cache/build-$1.log start=$SECONDS
  DOCKER_BUILDKIT=1 docker_cli build --network host --progress plain --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --target "$1" -t "kvstore-$1" "$root" >"$log" 2>&1 \
    || { tail -30 "$log" >&2; echo "error: docker build --target $1 failed; see $log" >&2; return 1; }
  step "built kvstore-$1 in $((SECONDS - start)) s"
}

install_packages
start_dockerd
step "wheelhouse (docker/wheels) and base image"
"$py" "$root/scripts/compose/wheelhouse.py" "$root/docker/wheels" 3.11.2 >"$cache/wheelhouse.log" 2>&1 &
wheels=$!
base_image
wait $wheels || { cat "$cache/wheelhouse.log" >&2; exit 1; }
cat "$cache/wheelhouse.log"
step "base image $BASE_IMAGE; building the images"
build store & store=$!
if [ "$REDIS_IMAGE" = kvstore-redis ]; then build redis & redis=$!; else redis=; fi
build engine
wait $store ${redis:+$redis}
printf 'BASE_IMAGE=%s\nREDIS_IMAGE=%s\n' "$BASE_IMAGE" "$REDIS_IMAGE" > "$cache/env"
docker_cli image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^(kvstore-(store|engine|redis):latest|kvstore-base:[^ ]*|python:3.11-slim|redis:7) ' | sed 's/^/  /' | sort
step "ready"
