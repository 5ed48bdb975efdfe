#!/usr/bin/env bash
# Generate the secrets docker-compose.yml mounts (Docker secrets, files under /run/secrets/):
#
#   store-tokens.yaml  the store's tokens file (--auth-tokens): tenant "engines" (read, write,
#                      shm) and "ops" (read, admin), tokens only as sha256 digests, as
#                      `kvstore tokens` writes them
#   engine-token       that token, for the engine (--store-token-file)
#   ops-token          a token of tenant "ops" (read, admin): the whole Stats, for operators
#                      and the compose test (`kvstore stats --token-file`); no container has it
#   ca.crt             the CA that signed the store's certificate (engine and health check)
#   store.crt, .key    the store's TLS certificate (DNS:kvstore, DNS:localhost, IP:127.0.0.1)
#
# usage: scripts/compose/secrets.sh DIR      (docker-compose.yml reads ${KVSTORE_SECRETS:-./secrets})
#
# Nothing here goes into an image or an environment variable.  Compose mounts secret files
# with their owner and mode, and both containers run as uid 10001: run as root, the private
# files are 0600 and owned by 10001; otherwise they are 0644 inside a 0700 directory.
# An existing complete DIR is kept (delete it to rotate).
set -euo pipefail
dir=${1:?usage: $0 DIR}
uid=${KVSTORE_UID:-10001}
files=(store-tokens.yaml engine-token ops-token ca.crt store.crt store.key)
if [ -d "$dir" ] && (cd "$dir" && ls "${files[@]}" >/dev/null 2>&1); then
  echo "secrets in $dir: kept"; exit 0
fi
command -v openssl >/dev/null || { echo "error: openssl is needed to make the secrets" >&2; exit 1; }
mkdir -p "$dir" && chmod 0700 "$dir"
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
openssl req -x509 "${key[@]}" -keyout "$tmp/ca.key" -out "$dir/ca.crt" -days 825 \
  -subj /CN=kvstore-compose-ca -addext basicConstraints=critical,CA:TRUE \
  -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
openssl req -new "${key[@]}" -keyout "$dir/store.key" -out "$tmp/store.csr" -subj /CN=kvstore 2>/dev/null
printf '%s\n' 'basicConstraints=CA:FALSE' 'keyUsage=critical,digitalSignature' \
  'extendedKeyUsage=serverAuth' 'subjectAltName=DNS:kvstore,DNS:localhost,IP:127.0.0.1' > "$tmp/ext"
openssl x509 -req -in "$tmp/store.csr" -CA "$dir/ca.crt" -CAkey "$tmp/ca.key" -set_serial "0x$(openssl rand -hex 8)" \
  -days 825 -extfile "$tmp/ext" -out "$dir/store.crt" 2>/dev/null
echo tokens: > "$dir/store-tokens.yaml"
for entry in "engine engines read,write,shm" "ops ops read,admin"; do
  read -r file tenant perms <<<"$entry"
  token=$(openssl rand -hex 32)
  (umask 077 && printf '%s\n' "$token" > "$dir/$file-token")
  printf '  - {sha256: "%s", tenant: "%s", permissions: [%s]}\n' \
    "$(printf '%s' "$token" | sha256sum | cut -d' ' -f1)" "$tenant" "${perms//,/, }" >> "$dir/store-tokens.yaml"
done
chmod 0644 "$dir/ca.crt" "$dir/store.crt"
if [ "$(id -u)" = 0 ]; then
  chown "$uid:$uid" "$dir/store.key" "$dir/engine-token" "$dir/store-tokens.yaml"
  chmod 0600 "$dir/store.key" "$dir/engine-token" "$dir/store-tokens.yaml"
else
  chmod 0644 "$dir/store.key" "$dir/engine-token" "$dir/store-tokens.yaml"
fi
echo "secrets in $dir: made (tokens of tenants engines and ops, TLS for kvstore/localhost/127.0.0.1)"
