#!/usr/bin/env bash
# A throw-away PostgreSQL server for tests: Debian's `postgresql` package, initdb + pg_ctl as an
# unprivileged user, listening on 127.0.0.1 only, a free port, a temp data directory.
#
#   .ci/pg-server.sh start DIR   # prints `export CTX_TUNER_TEST_DATABASE_URL=...` (eval it)
#   .ci/pg-server.sh restart DIR # stop + start on the same port (tests of a database restart)
#   .ci/pg-server.sh stop DIR    # stops the server; DIR is left for the caller to remove
#
# Installs the package with apt-get when initdb is missing and we are root (CI). Run as root, the
# server runs as the user `ctxtunerpg` (created when missing); as another user, as that user.
# Fails loudly on every error.
set -euo pipefail
cmd="${1:?usage: pg-server.sh start|stop|restart DIR}"
dir="${2:?usage: pg-server.sh start|stop|restart DIR}"
PGUSER_OS="${CTX_TUNER_PG_OS_USER:-ctxtunerpg}"

find_bin() {
    local b
    for b in /usr/lib/postgresql/*/bin; do
        if [ -x "$b/initdb" ] && [ -x "$b/pg_ctl" ]; then echo "$b"; return 0; fi
    done
    return 1
}

bin="$(find_bin || true)"
if [ -z "$bin" ] && [ "$cmd" = start ]; then
    if [ "$(id -u)" != 0 ]; then echo "pg-server: initdb not found and not root: install postgresql" >&2; exit 1; fi
    echo "pg-server: installing Debian's postgresql package" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
    bin="$(find_bin)" || { echo "pg-server: no initdb/pg_ctl under /usr/lib/postgresql/*/bin" >&2; exit 1; }
fi
[ -n "$bin" ] || { echo "pg-server: no initdb/pg_ctl under /usr/lib/postgresql/*/bin" >&2; exit 1; }

as_user() {  # run a command as the unprivileged server user
    if [ "$(id -u)" = 0 ]; then
        runuser -u "$PGUSER_OS" -- "$@"
    else
        "$@"
    fi
}

case "$cmd" in
start)
    if [ "$(id -u)" = 0 ] && ! id -u "$PGUSER_OS" >/dev/null 2>&1; then
        useradd --system --no-create-home --shell /usr/sbin/nologin "$PGUSER_OS"
    fi
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown "$PGUSER_OS" "$dir"
    chmod 700 "$dir"
    port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
    echo "$port" > "$dir/port"
    [ "$(id -u)" = 0 ] && chown "$PGUSER_OS" "$dir/port"
    as_user "$bin/initdb" -D "$dir/data" -U tuner --auth=trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
    as_user "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
        -o "-h 127.0.0.1 -p $port -k $dir -c fsync=off -c max_connections=200" start >&2 \
        || { cat "$dir/server.log" >&2; exit 1; }
    as_user "$bin/createdb" -h 127.0.0.1 -p "$port" -U tuner tuner_test >&2
    echo "export CTX_TUNER_TEST_DATABASE_URL=postgresql+psycopg://tuner@127.0.0.1:$port/tuner_test"
    echo "export CTX_TUNER_PG_DIR=$dir"
    ;;
restart)
    port="$(cat "$dir/port")"
    as_user "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >&2
    as_user "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
        -o "-h 127.0.0.1 -p $port -k $dir -c fsync=off -c max_connections=200" start >&2
    ;;
stop)
    if [ -f "$dir/data/postmaster.pid" ]; then
        as_user "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >&2
    fi
    ;;
*)
    echo "pg-server: unknown command $cmd" >&2; exit 2 ;;
esac
