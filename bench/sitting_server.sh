# Sourced by the bench/run_*.sh sittings: the one server a sitting runs at a time
# (SERVER_PID, stopped by `cleanup` and on exit), the timestamped log line, and
# `wait_healthy LOG`: until the server on $PORT answers /health (exits with its log's name
# if it dies or takes over 900 s).
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap cleanup EXIT
log() { echo "== $(date +%H:%M:%S) $*" >&2; }

wait_healthy() {  # wait_healthy LOG: until /health answers 200
  local deadline=$((SECONDS + 900))
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      log "the server exited during start-up; its log: $1"
      exit 1
    fi
    if [ $SECONDS -gt $deadline ]; then
      log "the server is not healthy after 900 s; its log: $1"
      exit 1
    fi
    sleep 0.5
  done
}
