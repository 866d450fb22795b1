"""The server end of megadiv's weight-update group, for tests/test_weight_sync.py (CPU, gloo).

An HTTP process that joins and uses the group the way SGLang 0.5.23 does (read from its
``init_weights_update_group`` / ``init_custom_process_group`` / ``update_weights_from_distributed``):
a TCP rendezvous at ``master_address:master_port`` as rank ``rank_offset``, a prefix store named
after the group, torch's ``_new_process_group_helper`` without ``device_id``; then, per update
request, one broadcast from rank 0 into a byte buffer of the announced size. Importing SGLang
itself takes over a minute on the CPU tier; the construction is the same.

    python tests/weight_sync_peer.py PORT

``/update_weights_from_distributed?mode=refuse`` answers HTTP 400 without joining the broadcast
(as SGLang does without an open weight-update session), ``mode=silent`` accepts and never joins.
"""
import datetime
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

GROUPS = {}
ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}


def join(req: dict) -> None:
    timeout = datetime.timedelta(seconds=60)
    url = f"tcp://{req['master_address']}:{req['master_port']}"
    store, rank, world = next(rendezvous(url, req["rank_offset"], req["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world, rank, [], Backend(req["backend"]),
                                      PrefixStore(req["group_name"], store), group_name=req["group_name"],
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    GROUPS[req["group_name"]] = pg


def receive(req: dict) -> int:
    size = sum(ELEMENT[d] * int(torch.Size(s).numel()) for d, s in zip(req["dtypes"], req["shapes"]))
    buf = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=GROUPS[req["group_name"]])
    return int(buf.long().sum())


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        parsed = urlparse(self.path)
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = parse_qs(parsed.query).get("mode", ["ok"])[0]
        status, body = 200, {"success": True}
        if parsed.path == "/init_weights_update_group":
            join(req)
        elif parsed.path == "/update_weights_from_distributed" and mode == "refuse":
            status, body = 400, {"success": False, "message": "no weight-update session is open"}
        elif parsed.path == "/update_weights_from_distributed" and mode == "silent":
            time.sleep(30)
        elif parsed.path == "/update_weights_from_distributed":
            body["checksum"] = receive(req)
        elif parsed.path == "/destroy_weights_update_group":
            pg = GROUPS.pop(req["group_name"], None)
            if pg is not None:
                dist.destroy_process_group(pg)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
