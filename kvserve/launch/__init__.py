"""The processes of one server, their start, supervision and stop.

    kvserve serve (this process: api + uvicorn, no torch)
      ├── DPCoordinator (spawned, only with more than one engine core; no torch)
      ├── KvStore (spawned, only with --prefill-size/--decode-size; no torch)
      └── EngineCore_0 .. EngineCore_{L-1} (spawned; run_engine_core; torch)
            └── workers (the `mp` executor, when TP x PP > 1)

The launcher (serve.py) binds the api's sockets, starts the engine cores, loads the tokenizer
while the engines load the model, waits for READY from all N engines (the remote ones too),
then serves HTTP (api_server.py). An engine process that dies fails its in-flight requests
(503, or an error chunk naming it); the others serve on; when none is left the launcher exits
1, naming the dead process. With --restart-dead-engines the launcher restarts a dead engine
core instead (its leftover workers killed first; 1 s to 30 s of back-off while it keeps dying
young; supervisor.py), the api readmits it once it says READY, and answers 503 while no
engine core serves. The DP coordinator is always supervised: one that dies is restarted on
the same addresses (engines and the api reconnect by themselves; routing runs on the api's
own estimates meanwhile). SIGTERM / SIGINT: stop accepting, drain in-flight requests for up
to --shutdown-timeout seconds, stop the engines (which stop their workers) and the
coordinator, exit 0.

Multi-node (`--data-parallel-size-local L0 < N`): the front end binds its sockets on
--data-parallel-address (tcp, ports the OS picks) and answers the registration of headless
nodes on --data-parallel-rpc-port for as long as it runs, so a node that restarts (or comes
late) joins again; `kvserve serve --headless` nodes run engines only (headless.py). A
headless engine core shuts down after KVSERVE_FRONTEND_TIMEOUT_S without a word from the
api, and its node then exits 0 (start it again to join the next front end).

P/D disaggregation (`--prefill-size N --decode-size M`): a KV store on an ipc:// address in a
fresh temporary folder, engines 0..N-1 with kv_role kv_producer and N..N+M-1 with
kv_consumer, each a KvStoreConnector to that store (children.py). The api sends each request
to a prefill engine first (max_tokens 1), then to a decode engine (see
services/api/engine_client/pd_flow.py). The store stops after the engines, and takes its shared
memory with it.

Modules: serve.py (the `serve`, `engine` and `coordinator` commands), api_server.py (the api
process; `kvserve api`), engines.py (the engine core processes), children.py (the
coordinator, the KV store, the registration server), headless.py (`serve --headless`),
supervisor.py (restarts and stops).
"""
