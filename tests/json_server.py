"""A real HTTP server on 127.0.0.1 that answers POSTed JSON from a script, for the tests of a team's services
(the reward endpoint, the LLM judge).

    with JSONServer([(503, {"error": "warming up"}), (200, lambda body: {"rewards": [1.0]})], path="/score") as server:
        ...  # server.url; server.requests: (path, headers, body) of each request, in order

A 3xx status with a reply ``{"location": url}`` answers a redirect there; ``host`` binds another loopback
address (127.0.0.2: a second host, for the allow-list's tests).
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JSONServer:
    """One (status, reply) per request, the last repeating; a callable reply is called with the request's JSON."""

    def __init__(self, script, path: str = "/", host: str = "127.0.0.1"):
        self.script, self.requests = list(script), []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                owner.requests.append((self.path, dict(self.headers), body))
                status, reply = owner.script[min(len(owner.requests), len(owner.script)) - 1]
                if callable(reply):
                    reply = reply(body)
                if 300 <= status < 400:
                    self.send_response(status)
                    self.send_header("Location", reply["location"])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST  # where a 302 sends a POST

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}{path}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
