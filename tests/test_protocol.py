"""The stdio JSON-RPC layer, driven through a real server subprocess."""

import json
import os
import signal
import subprocess
import unittest

import support
from support import Server, WorkspaceTest

VERSIONS = ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"]
NEWEST = "2025-11-25"
TOOLS = {"tc_init", "tc_switch", "tc_save", "tc_capture", "tc_show", "tc_restore",
         "tc_resume", "tc_export", "tc_import", "tc_compress"}


class ProtocolTest(WorkspaceTest):
    shared = None

    @classmethod
    def tearDownClass(cls):
        if cls.shared is not None:
            cls.shared.close()
            cls.shared = None
        super().tearDownClass()

    def shared_server(self):
        """One initialized server for the whole class (restarted if it died)."""
        cls = type(self)
        if cls.shared is None or cls.shared.proc.poll() is not None:
            cls.shared = Server()
            cls.shared.initialize()
        return cls.shared

    def raw_server(self, **kwargs):
        """A server that has not been initialized."""
        srv = Server(**kwargs)
        self._servers.append(srv)
        return srv

    def send_line(self, srv, data):
        if isinstance(data, str):
            data = data.encode("utf-8")
        srv.send_raw(data + b"\n")
        return srv.read_line()

    def assert_error(self, reply, codes, ids=(None,)):
        self.assertEqual(reply.get("jsonrpc"), "2.0", reply)
        self.assertIn("error", reply, reply)
        self.assertNotIn("result", reply, reply)
        self.assertIn(reply["error"].get("code"), codes, reply)
        self.assertIsInstance(reply["error"].get("message"), str)
        self.assertTrue(reply["error"]["message"])
        self.assertIn("id", reply)
        self.assertIn(reply["id"], ids, reply)

    def assert_alive(self, srv):
        reply = srv.request("ping")
        self.assertEqual(reply.get("result"), {}, reply)


class InitializeTest(ProtocolTest):
    def initialize_all(self, params_list):
        """Each params object sent to its own fresh server (started together)."""
        servers = [self.raw_server() for _ in params_list]
        results = []
        for srv, params in zip(servers, params_list):
            msg = {"jsonrpc": "2.0", "id": 1, "method": "initialize"}
            if params is not None:
                msg["params"] = params
            reply = self.send_line(srv, json.dumps(msg))
            self.assertEqual(reply.get("id"), 1, reply)
            self.assertIn("result", reply, reply)
            results.append(reply["result"])
        return results

    def initialize(self, params):
        return self.initialize_all([params])[0]

    def test_known_versions_are_echoed(self):
        results = self.initialize_all([{"protocolVersion": v, "capabilities": {},
                                        "clientInfo": {"name": "t", "version": "1"}}
                                       for v in VERSIONS])
        self.assertEqual([r["protocolVersion"] for r in results], VERSIONS)

    def test_unknown_or_missing_version_gets_the_newest(self):
        params = [{"protocolVersion": v, "capabilities": {}}
                  for v in ("1999-01-01", "2026-01-01", "latest", 20250618)]
        params += [{"capabilities": {}}, None]
        results = self.initialize_all(params)
        self.assertEqual([r["protocolVersion"] for r in results], [NEWEST] * len(params))

    def test_server_info_and_capabilities(self):
        result = self.initialize({"protocolVersion": "2025-06-18", "capabilities": {}})
        self.assertEqual(result["serverInfo"]["name"], "task-checkpoint-mcp")
        proc = subprocess.run([*support.SERVER_COMMAND, "--version"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=support.clean_env(), timeout=30)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        printed = proc.stdout.decode().strip()
        self.assertEqual(printed, "task-checkpoint-mcp " + result["serverInfo"]["version"])
        self.assertEqual(result["serverInfo"]["version"], "0.1.0")
        self.assertIsInstance(result["capabilities"], dict)
        self.assertIsInstance(result["capabilities"].get("tools"), dict)


class MessageHandlingTest(ProtocolTest):
    def setUp(self):
        super().setUp()
        self.srv = self.shared_server()

    def test_ping(self):
        reply = self.srv.request("ping")
        self.assertEqual(reply, {"jsonrpc": "2.0", "id": self.srv._id, "result": {}})

    def test_unknown_method(self):
        reply = self.srv.request("resources/frobnicate", {})
        self.assert_error(reply, (-32601,), ids=(self.srv._id,))
        self.assert_alive(self.srv)

    def test_not_json(self):
        for line in ("this is not json", '{"jsonrpc": "2.0", "id": 4, "method": "ping"',
                     "{'single': 'quotes'}", "[1, 2,]"):
            with self.subTest(line=line):
                reply = self.send_line(self.srv, line)
                self.assert_error(reply, (-32700,))
                # Says what is wrong and where, not the parser's exception name.
                self.assertRegex(reply["error"]["message"], r"not valid JSON \(.+ at column \d+\)")
        reply = self.send_line(self.srv, b"\xff\xfe")
        self.assertIn("not UTF-8 (byte 0)", reply["error"]["message"])
        self.assert_alive(self.srv)

    def test_json_that_is_not_a_request(self):
        for line in ("42", '"hello"', "null", "true"):
            with self.subTest(line=line):
                self.assert_error(self.send_line(self.srv, line), (-32600,))
        reply = self.send_line(self.srv, '{"jsonrpc": "2.0", "id": 9}')
        self.assert_error(reply, (-32600,), ids=(None, 9))
        reply = self.send_line(self.srv, '{"jsonrpc": "2.0", "id": 10, "method": 5}')
        self.assert_error(reply, (-32600,), ids=(None, 10))
        self.assert_alive(self.srv)

    def test_ids_mcp_does_not_allow_are_refused(self):
        # MCP: a string or an integer, never null.
        for raw in ("null", "1.5", "true", "[1]", '{"a": 1}'):
            with self.subTest(id=raw):
                reply = self.send_line(self.srv, '{"jsonrpc": "2.0", "id": %s, "method": '
                                                 '"ping"}' % raw)
                self.assert_error(reply, (-32600,))
        for raw, echoed in (('"abc"', "abc"), ("-3", -3), ("7.0", 7.0)):
            reply = self.send_line(self.srv, '{"jsonrpc": "2.0", "id": %s, "method": "ping"}'
                                   % raw)
            self.assertEqual((type(reply["id"]), reply["id"], reply.get("result")),
                             (type(echoed), echoed, {}), reply)
        self.assert_alive(self.srv)

    def test_batch_is_refused(self):
        batch = json.dumps([{"jsonrpc": "2.0", "id": 11, "method": "ping"},
                            {"jsonrpc": "2.0", "id": 12, "method": "ping"}])
        reply = self.send_line(self.srv, batch)
        self.assertIsInstance(reply, dict, "a batch must get one error object, not an array")
        self.assert_error(reply, (-32600,))
        self.assert_error(self.send_line(self.srv, "[]"), (-32600,))
        self.assert_alive(self.srv)

    def test_notifications_are_never_answered(self):
        self.srv.notify("notifications/initialized")
        self.srv.notify("notifications/cancelled", {"requestId": 99})
        self.srv.notify("notifications/no-such-thing")
        self.srv.notify("some/unknown/method", {"x": 1})
        # The very next line on stdout must be the ping's answer.
        reply = self.srv.request("ping")
        self.assertEqual(reply.get("result"), {})

    def test_a_server_logs_into_the_store_of_the_workspace_it_serves(self):
        first = self.server()
        first.ok("tc_init", root=self.root, name="logged")
        first.close()
        log = os.path.join(self.store, "server.log")
        if os.path.exists(log):
            os.remove(log)
        srv = self.server()  # it never runs tc_init, nor gets a result naming the store
        srv.ok("tc_show", root=self.root)
        srv.notify("tools/list")  # a request sent as a notification: logged, not run
        self.assertEqual(srv.request("ping").get("result"), {})
        with open(log, encoding="utf-8") as fh:
            self.assertIn("ignored 'tools/list' sent as a notification", fh.read())

    def test_ids_are_echoed_exactly(self):
        for request_id in ("abc", "", "任务-1", "\ud800 lone surrogate", 0, -7, 2 ** 53):
            with self.subTest(request_id=request_id):
                line = json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "ping"})
                reply = self.send_line(self.srv, line)
                self.assertEqual(reply.get("id"), request_id)
                self.assertEqual(reply.get("result"), {})

    def test_blank_lines_are_ignored_or_answered_without_harm(self):
        self.srv.send_raw(b"\n")
        self.srv.send_raw(b"\r\n")
        self.srv.send_raw(b'{"jsonrpc":"2.0","id":"after-blank","method":"ping"}\r\n')
        while True:
            reply = self.srv.read_line()
            if reply.get("id") == "after-blank":
                break
            self.assert_error(reply, (-32700, -32600))
        self.assertEqual(reply.get("result"), {})

    def test_invalid_utf8(self):
        reply = self.send_line(self.srv, b'{"jsonrpc":"2.0","id":21,"method":"ping","x":"\xff\xfe"}')
        self.assert_error(reply, (-32700, -32600), ids=(None, 21))
        reply = self.send_line(self.srv, b"\xc3\x28\xa0\xa1 not utf-8")
        self.assert_error(reply, (-32700,))
        self.assert_alive(self.srv)

    def test_random_bytes(self):
        noise = bytes((i * 197 + 31) % 256 for i in range(4096)).replace(b"\n", b"\x00")
        reply = self.send_line(self.srv, noise)
        self.assert_error(reply, (-32700,))
        reply = self.send_line(self.srv, b"\x00\x01\x02\x03")
        self.assert_error(reply, (-32700,))
        self.assert_alive(self.srv)

    def test_deeply_nested_json(self):
        depth = 10000
        reply = self.send_line(self.srv, "[" * depth + "]" * depth)
        self.assert_error(reply, (-32700, -32600))
        self.assert_alive(self.srv)
        nested = '{"a":' * depth + "1" + "}" * depth
        line = '{"jsonrpc":"2.0","id":31,"method":"ping","params":%s}' % nested
        reply = self.send_line(self.srv, line)
        # Either refused or answered, but a well-formed reply and a live server.
        self.assertEqual(reply.get("jsonrpc"), "2.0", reply)
        self.assertTrue(("error" in reply) != ("result" in reply), reply)
        if "error" in reply:
            self.assertIn(reply["id"], (None, 31))
            self.assertIsInstance(reply["error"]["code"], int)
        else:
            self.assertEqual(reply["id"], 31)
        self.assert_alive(self.srv)

    def test_huge_string_argument(self):
        huge = "/" + "a" * (20 * 1024 * 1024)
        msg = {"jsonrpc": "2.0", "id": 41, "method": "tools/call",
               "params": {"name": "tc_show", "arguments": {"root": huge}}}
        reply = self.send_line(self.srv, json.dumps(msg))
        self.assertIn(reply.get("id"), (41, None), str(reply)[:500])
        if "error" in reply:
            self.assertIsInstance(reply["error"]["code"], int)
        else:
            self.assertTrue(reply["result"]["isError"], str(reply)[:500])
            self.assertLess(len(reply["result"]["content"][0]["text"]), 4096,
                            "the error text should not echo the whole argument back")
        self.assert_alive(self.srv)
        self.assertEqual(os.listdir(self.root), [])

    def test_line_over_the_limit_is_refused_and_skipped(self):
        # 200 MiB of one request: refused after the first 64 MiB, the rest
        # skipped without being kept, and the next line read as a request.
        chunk = b"a" * (1024 * 1024)
        self.srv.send_raw(b'{"jsonrpc":"2.0","id":51,"method":"ping","params":{"x":"')
        for _ in range(200):
            self.srv.send_raw(chunk)
        self.srv.send_raw(b'"}}\n')
        reply = self.srv.read_line()
        self.assertIsNone(reply["id"], reply)
        self.assertEqual(reply["error"]["code"], -32600, reply)
        self.assertIn("64 MiB", reply["error"]["message"])
        pong = self.srv.request("ping", {})
        self.assertEqual(pong.get("result"), {}, pong)
        status = "/proc/%d/status" % self.srv.proc.pid
        if not os.path.exists(status):
            return  # no /proc (macOS, Windows): the memory is not measured there
        with open(status) as fh:
            peak = [line for line in fh if line.startswith("VmHWM")]
        if peak:  # the line was never held whole
            self.assertLess(int(peak[0].split()[1]), 200 * 1024, peak[0])


    def test_a_line_of_millions_of_small_values_is_refused_unparsed(self):
        # 21 MB that would parse into 7 million objects (gigabytes in memory).
        line = (b'{"jsonrpc":"2.0","id":52,"method":"ping","params":{"x":['
                + b"{}," * 7_000_000 + b'{}]}}\n')
        self.srv.send_raw(line)
        reply = self.srv.read_line()
        self.assertEqual(reply["error"]["code"], -32600, reply)
        self.assertEqual(reply["id"], 52, reply)
        self.assertIn("values", reply["error"]["message"])
        # An id that only looks like one is no id: no answer, and the server goes on.
        for bad_id in (b"01", b'"\t"'):
            self.srv.send_raw(b'{"method":"ping","params":{"x":[' + b"[]," * 2_000_000
                              + b'[]]},"jsonrpc":"2.0","id":' + bad_id + b'}\n')
        # Its id also when it comes last, as some clients write it.
        self.srv.send_raw(b'{"method":"ping","params":{"x":[' + b"[]," * 2_000_000
                          + b'[]]},"jsonrpc":"2.0","id":53}\n')
        self.assertEqual(self.srv.read_line()["id"], 53)
        # A notification that size gets no answer, even with an id inside its
        # params, nor does a response; the ping after them gets its own.
        self.srv.send_raw(b'{"jsonrpc":"2.0","method":"notifications/x","params":{"id":1,"x":['
                          + b"[]," * 2_000_000 + b'[]]}}\n')
        self.srv.send_raw(b'{"jsonrpc":"2.0","id":54,"result":{"x":['
                          + b"[]," * 2_000_000 + b'[]]}}\n')
        # Many commas, then a string of two million escaped quotes: counted
        # in one pass (a scan from each quote took minutes), and read.
        self.srv.send_raw(b'{"jsonrpc":"2.0","id":55,"method":"ping","params":[' + b"1," * 600_000
                          + b'"' + b'\\"' * 2_000_000 + b'"]}\n')
        self.assertEqual(self.srv.read_line(), {"jsonrpc": "2.0", "id": 55, "result": {}})
        # Commas and brackets inside text are text: a large request of prose is read.
        prose = ["item %d: a, b, [c], {d}, " % n * 300 for n in range(1000)]
        reply = self.srv.request("tools/call", {"name": "tc_save", "arguments": {
            "root": self.root, "title": "t", "open_questions": prose}})
        self.assertIn("result", reply, str(reply)[:300])
        pong = self.srv.request("ping", {})
        self.assertEqual(pong.get("result"), {}, pong)
        status = "/proc/%d/status" % self.srv.proc.pid
        if not os.path.exists(status):
            return
        with open(status) as fh:
            peak = [line for line in fh if line.startswith("VmHWM")]
        if peak:
            self.assertLess(int(peak[0].split()[1]), 300 * 1024, peak[0])

ENVELOPE = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "tests", "version": "0"}}


class EnvelopeRevisionTest(ProtocolTest):
    """The 2026-07-28 revision has no handshake: each request carries its
    version in params._meta, and every result says it is complete."""

    def enveloped(self, srv, method, params=None, meta=ENVELOPE):
        return srv.request(method, dict(params or {}, _meta=dict(meta)))

    def assert_enveloped_result(self, reply):
        result = reply["result"]
        self.assertEqual(result["resultType"], "complete", reply)
        self.assertEqual(result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"],
                         "task-checkpoint-mcp")
        return result

    def test_discover_then_tools_without_a_handshake(self):
        srv = self.raw_server()
        found = self.assert_enveloped_result(self.enveloped(srv, "server/discover"))
        self.assertEqual(found["supportedVersions"], ["2026-07-28"])
        self.assertIn("tools", found["capabilities"])
        self.assertTrue(found["instructions"])
        self.assertEqual((found["ttlMs"], found["cacheScope"]), (0, "private"))
        listed = self.assert_enveloped_result(self.enveloped(srv, "tools/list"))
        self.assertEqual((listed["ttlMs"], listed["cacheScope"]), (0, "private"))
        legacy = srv.request("tools/list")["result"]
        self.assertNotIn("resultType", legacy)
        self.assertEqual(listed["tools"], legacy["tools"])
        call = {"name": "tc_init", "arguments": {"root": self.root, "name": "envelope"}}
        started = self.assert_enveloped_result(self.enveloped(srv, "tools/call", call))
        self.assertFalse(started["isError"], started)
        self.assertTrue(started["structuredContent"]["task_id"].startswith("envelope-"))
        refused = self.assert_enveloped_result(self.enveloped(srv, "tools/call", {
            "name": "tc_switch", "arguments": {"root": self.root, "task_id": "nope-1"}}))
        self.assertTrue(refused["isError"])
        # A handshake request's _meta (a progress token) does not make it enveloped.
        plain = srv.request("tools/call", {"name": "tc_resume", "arguments": {"root": self.root},
                                           "_meta": {"progressToken": 7}})["result"]
        self.assertNotIn("resultType", plain)
        self.assertFalse(plain["isError"], plain)

    def test_bad_envelopes_are_refused_before_anything_runs(self):
        srv = self.raw_server()
        call = {"name": "tc_init", "arguments": {"root": self.root, "name": "never"}}
        reply = self.enveloped(srv, "tools/call", call,
                               dict(ENVELOPE, **{"io.modelcontextprotocol/protocolVersion":
                                                 "2099-01-01"}))
        self.assert_error(reply, (-32022,), ids=(reply["id"],))
        # The handshake revisions are named too, so the client can fall back.
        self.assertEqual(reply["error"]["data"], {"supported": ["2026-07-28"] + VERSIONS,
                                                  "requested": "2099-01-01"})
        reply = self.enveloped(srv, "no/such/method", {},
                               dict(ENVELOPE, **{"io.modelcontextprotocol/protocolVersion":
                                                 "2099-01-01"}))
        self.assert_error(reply, (-32022,), ids=(reply["id"],))
        no_capabilities = {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}
        reply = self.enveloped(srv, "tools/call", call, no_capabilities)
        self.assert_error(reply, (-32602,), ids=(reply["id"],))
        self.assertIn("clientCapabilities", reply["error"]["message"])
        reply = self.enveloped(srv, "tools/call", call,
                               dict(ENVELOPE, **{"io.modelcontextprotocol/protocolVersion": 2026}))
        self.assert_error(reply, (-32602,), ids=(reply["id"],))
        reply = self.enveloped(srv, "tools/call", call,
                               dict(ENVELOPE, **{"io.modelcontextprotocol/clientCapabilities": []}))
        self.assert_error(reply, (-32602,), ids=(reply["id"],))
        self.assertFalse(os.path.exists(os.path.join(self.root, ".checkpoints")))
        self.assert_alive(srv)

    def test_discover_without_an_envelope_still_names_the_server(self):
        found = self.raw_server().request("server/discover")["result"]
        self.assertEqual(found["resultType"], "complete")
        self.assertEqual(found["_meta"]["io.modelcontextprotocol/serverInfo"]["name"],
                         "task-checkpoint-mcp")

    def test_initialize_stays_the_handshake(self):
        srv = self.raw_server()
        reply = self.enveloped(srv, "initialize", {
            "protocolVersion": "2026-07-28", "capabilities": {},
            "clientInfo": {"name": "tests", "version": "0"}})
        self.assertEqual(reply["result"]["protocolVersion"], "2025-11-25")
        self.assertNotIn("resultType", reply["result"])


class CommandLineTest(unittest.TestCase):
    """What the server says on stderr about how it was started."""

    def start(self, args=(), env=None):
        ping = b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n'
        proc = subprocess.run([*support.SERVER_COMMAND, *args], input=ping,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=support.clean_env(env), timeout=30)
        return proc, proc.stderr.decode("utf-8", "replace")

    def test_unrecognised_arguments_are_named_and_the_server_starts(self):
        proc, err = self.start(["--stdio", "--bogus"])
        self.assertEqual(proc.returncode, 0, err)
        self.assertEqual(json.loads(proc.stdout)["result"], {})
        self.assertIn("ignoring unrecognised argument(s): --stdio --bogus", err)
        proc, err = self.start(["--version", "--bogus"])
        self.assertEqual(proc.stdout.decode().strip(), "task-checkpoint-mcp 0.1.0")
        self.assertIn("ignoring unrecognised argument(s): --bogus", err)

    def test_shortened_flags_and_switches_given_values_are_unrecognised_too(self):
        # Neither may turn a client's extra argument into a run of another flag
        # or a failed start.
        for args in (["--ver"], ["--s"], ["--pr"], ["--in", "somewhere"], ["--version=2"],
                     ["--force=yes"], ["--help=me"], ["-hx"], ["-help"], ["-h=1"],
                     ["-hostname", "x"]):
            proc, err = self.start(args)
            self.assertEqual(proc.returncode, 0, (args, err))
            self.assertEqual(json.loads(proc.stdout)["result"], {}, args)
            self.assertIn("ignoring unrecognised argument(s): %s" % " ".join(args), err)

    def test_environment_values_it_does_not_take_are_named(self):
        proc, err = self.start(env={"TC_GIT": "disabled", "TC_WATCH_INTERVAL": "abc",
                                    "TC_WORK_THREADS": "32", "TC_SHA_REUSE": "YES",
                                    "TC_DRIFT_MAX_WAIT": "", "TC_WATCH_EVENTS": "0"})
        self.assertEqual(json.loads(proc.stdout)["result"], {})
        self.assertIn("TC_GIT='disabled' is not one of on/off, 1/0, true/false, yes/no; "
                      "the default (on) is used", err)
        self.assertIn("TC_WATCH_INTERVAL='abc' is not a number of seconds from 0.05 to "
                      "31622400; the default (15) is used", err)
        self.assertIn("TC_WORK_THREADS='32' is not a whole number from 1 to 16", err)
        for fine in ("TC_SHA_REUSE", "TC_DRIFT_MAX_WAIT", "TC_WATCH_EVENTS", "TC_WATCH="):
            self.assertNotIn(fine, err)
        # A wait that long would stop the watcher thread with an OverflowError.
        proc, err = self.start(env={"TC_WATCH": "on", "TC_WATCH_INTERVAL": "inf"})
        self.assertEqual(json.loads(proc.stdout)["result"], {})
        self.assertIn("TC_WATCH_INTERVAL='inf' is not a number of seconds", err)
        self.assertNotIn("Traceback", err)
        proc, err = self.start()
        self.assertEqual(err, "")

    @unittest.skipUnless(hasattr(os, "openpty"), "needs a pseudo-terminal")
    def test_a_terminal_on_stdin_is_told_what_the_server_waits_for(self):
        # Started by hand, the server says once on stderr what it is; it still
        # serves, and stdout carries frames only. With pipes it says nothing
        # (the end of test_environment_values_it_does_not_take_are_named).
        main, terminal = os.openpty()
        self.addCleanup(os.close, main)
        try:
            proc = subprocess.Popen(support.SERVER_COMMAND, stdin=terminal,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=support.clean_env())
        finally:
            os.close(terminal)
        # A line, then Ctrl-D at the start of the next: the end of the input.
        os.write(main, b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n\x04')
        out, err = proc.communicate(timeout=30)
        self.assertEqual(proc.returncode, 0, err)
        self.assertEqual(json.loads(out)["result"], {})
        lines = err.decode("utf-8", "replace").splitlines()
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("MCP server", lines[0])
        self.assertIn("stdin/stdout", lines[0])
        self.assertIn("tc-mcp --help", lines[0])


class ToolsListTest(ProtocolTest):
    def test_exactly_the_ten_tools(self):
        srv = self.server()
        reply = srv.request("tools/list", {})
        tools = reply["result"]["tools"]
        names = [tool["name"] for tool in tools]
        self.assertEqual(sorted(names), sorted(TOOLS))
        self.assertEqual(len(names), 10)
        for tool in tools:
            with self.subTest(tool=tool["name"]):
                self.assertIsInstance(tool["description"], str)
                self.assertGreater(len(tool["description"].strip()), 10)
                schema = tool["inputSchema"]
                self.assertEqual(schema.get("type"), "object")
                self.assertIs(schema.get("additionalProperties"), False)
                self.assertIn("root", schema["properties"])
                self.assertIn("root", schema.get("required", []))
                self.assertEqual(schema["properties"]["root"].get("type"), "string")
                out = tool["outputSchema"]
                self.assertEqual(out.get("type"), "object")
                self.assertIsInstance(out.get("properties"), dict)
                self.assertTrue(out["properties"])

    def test_titles_and_hints(self):
        tools = {tool["name"]: tool for tool in
                 self.server().request("tools/list", {})["result"]["tools"]}
        for name, tool in tools.items():
            with self.subTest(tool=name):
                hints = tool["annotations"]
                self.assertEqual(hints["title"], tool["title"])
                self.assertTrue(tool["title"].strip())
                for key in ("readOnlyHint", "destructiveHint", "idempotentHint",
                            "openWorldHint"):
                    self.assertIsInstance(hints[key], bool)
                self.assertIs(hints["openWorldHint"], False)
        self.assertEqual({n for n, t in tools.items() if t["annotations"]["readOnlyHint"]},
                         {"tc_show", "tc_resume"})
        self.assertEqual({n for n, t in tools.items() if t["annotations"]["destructiveHint"]},
                         {"tc_restore", "tc_import", "tc_compress"})

    def test_tools_list_without_params(self):
        srv = self.server()
        reply = srv.request("tools/list")
        self.assertEqual(len(reply["result"]["tools"]), 10)

    def test_tools_list_refuses_a_cursor_it_never_gave(self):
        srv = self.server()
        self.assertEqual(len(srv.request("tools/list", {"cursor": None})["result"]["tools"]), 10)
        for cursor in ("page-2", 5, ""):
            reply = srv.request("tools/list", {"cursor": cursor})
            self.assertEqual(reply["error"]["code"], -32602, reply)
            self.assertIn("cursor", reply["error"]["message"])


class ToolCallErrorsTest(ProtocolTest):
    def setUp(self):
        super().setUp()
        self.srv = self.shared_server()

    def assert_argument_error(self, tool, argument, /, **arguments):
        res = self.srv.call(tool, **arguments)
        self.assertTrue(res.is_error, "%s %r was accepted: %r" % (tool, arguments, res))
        self.assertIn(argument, res.text, "the message should name %r" % argument)
        self.assertNotIn("Traceback", res.text)
        return res

    def test_unknown_tool(self):
        reply = self.srv.request("tools/call", {"name": "tc_nope", "arguments": {"root": self.root}})
        self.assert_error(reply, (-32602,), ids=(self.srv._id,))
        for params in ({"arguments": {}}, []):
            reply = self.srv.request("tools/call", params)
            self.assert_error(reply, (-32602,), ids=(self.srv._id,))
            self.assertIn("needs params.name", reply["error"]["message"])
        self.assert_alive(self.srv)

    def test_wrong_types(self):
        self.assert_argument_error("tc_show", "root", root=123)
        self.assert_argument_error("tc_show", "limit", root=self.root, limit="10")
        self.assert_argument_error("tc_show", "limit", root=self.root, limit=True)
        self.assert_argument_error("tc_show", "limit", root=self.root, limit=1.5)
        self.assert_argument_error("tc_show", "include_drift", root=self.root, include_drift="yes")
        self.assert_argument_error("tc_init", "exclude", root=self.root, name="x", exclude="logs")
        self.assert_argument_error("tc_init", "exclude", root=self.root, name="x", exclude=[1])
        self.assert_argument_error("tc_save", "close", root=self.root, title="t", close="true")
        self.assert_argument_error("tc_save", "verified", root=self.root, title="t", verified="ran")
        self.assert_argument_error("tc_init", "name", root=self.root, name=None)
        self.assertEqual(os.listdir(self.root), [])

    def test_missing_required(self):
        self.assert_argument_error("tc_init", "name", root=self.root)
        self.assert_argument_error("tc_save", "title", root=self.root)
        self.assert_argument_error("tc_switch", "task_id", root=self.root)
        self.assert_argument_error("tc_export", "to", root=self.root)
        self.assert_argument_error("tc_import", "package", root=self.root)
        self.assert_argument_error("tc_resume", "root")
        self.assertEqual(os.listdir(self.root), [])

    def test_unknown_property(self):
        self.assert_argument_error("tc_show", "bogus", root=self.root, bogus=1)
        self.assert_argument_error("tc_init", "colour", root=self.root, name="x", colour="red")
        self.assertEqual(os.listdir(self.root), [])

    def test_made_up_names_are_echoed_briefly(self):
        # Many long unknown names: the message names a few, shortened, and counts the rest.
        many = {"x%05d%s" % (n, "y" * 200): n for n in range(2000)}
        res = self.assert_argument_error("tc_show", "x00000", root=self.root, **many)
        self.assertIn("and 1995 more", res.text)
        self.assertLess(len(res.text), 2000)
        reply = self.srv.request("tools/call", {"name": "t" * 100000, "arguments": {}})
        self.assert_error(reply, (-32602,), ids=(self.srv._id,))
        self.assertLess(len(reply["error"]["message"]), 200)
        reply = self.srv.request("m" * 100000)
        self.assert_error(reply, (-32601,), ids=(self.srv._id,))
        self.assertLess(len(reply["error"]["message"]), 200)

    def test_out_of_range(self):
        self.assert_argument_error("tc_show", "limit", root=self.root, limit=0)
        self.assert_argument_error("tc_show", "limit", root=self.root, limit=201)
        self.assert_argument_error("tc_show", "index", root=self.root, index=0)
        self.assert_argument_error("tc_show", "index", root=self.root, index=-3)
        self.assert_argument_error("tc_show", "cursor", root=self.root, cursor=-1)
        self.assert_argument_error("tc_restore", "index", root=self.root, index=0)
        self.assertEqual(os.listdir(self.root), [])

    def test_meta_in_params_is_accepted(self):
        reply = self.srv.request("tools/call", {
            "name": "tc_init", "arguments": {"root": self.root, "name": "meta"},
            "_meta": {"progressToken": "p-1"}})
        self.assertIn("result", reply, reply)
        self.assertFalse(reply["result"]["isError"], reply)
        self.assertEqual(reply["result"]["structuredContent"]["name"], "meta")

    def test_arguments_must_be_an_object(self):
        reply = self.srv.request("tools/call", {"name": "tc_show", "arguments": [self.root]})
        if "error" in reply:
            self.assertIsInstance(reply["error"]["code"], int)
        else:
            self.assertTrue(reply["result"]["isError"], reply)
        self.assert_alive(self.srv)

    def test_call_before_initialize_is_well_formed(self):
        srv = self.raw_server()
        reply = self.send_line(srv, json.dumps({
            "jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "tc_show", "arguments": {"root": self.root}}}))
        self.assertEqual(reply.get("jsonrpc"), "2.0")
        self.assertEqual(reply.get("id"), 1)
        self.assertTrue(("error" in reply) != ("result" in reply), reply)
        if "error" in reply:
            self.assertIsInstance(reply["error"]["code"], int)
        else:
            self.assertIsInstance(reply["result"].get("content"), list)
        reply = self.send_line(srv, '{"jsonrpc":"2.0","id":2,"method":"tools/list"}')
        self.assertEqual(reply.get("id"), 2)
        self.assertTrue(("error" in reply) != ("result" in reply), reply)
        self.assertEqual(srv.proc.poll(), None, "server exited")


class StreamTest(ProtocolTest):
    def test_stdout_carries_only_json_lines(self):
        requests = [
            {"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-06-18", "capabilities": {}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
            {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
             "params": {"name": "tc_init", "arguments": {"root": self.root, "name": "stream"}}},
            {"jsonrpc": "2.0", "id": 4, "method": "tools/call",
             "params": {"name": "tc_save", "arguments": {"root": self.root, "title": "one"}}},
            {"jsonrpc": "2.0", "id": 5, "method": "tools/call",
             "params": {"name": "tc_resume", "arguments": {"root": self.root}}},
            {"jsonrpc": "2.0", "id": 6, "method": "tools/call",
             "params": {"name": "tc_show", "arguments": {"root": "relative/path"}}},
            {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
             "params": {"name": "tc_switch", "arguments": {"root": self.root, "task_id": "../x"}}},
            {"jsonrpc": "2.0", "id": 8, "method": "nope"},
            {"jsonrpc": "2.0", "id": 9, "method": "ping"},
        ]
        data = "".join(json.dumps(r) + "\n" for r in requests).encode("utf-8")
        data += b"garbage\n"
        self.write("src/a.py", "print('hi')\n")
        proc = subprocess.run(list(support.SERVER_COMMAND), input=data,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=support.clean_env(), cwd=self.tmp, timeout=60)
        lines = proc.stdout.split(b"\n")
        self.assertEqual(lines[-1], b"", "stdout must end with a newline")
        parsed = [json.loads(line.decode("utf-8")) for line in lines[:-1]]
        for msg in parsed:
            self.assertIsInstance(msg, dict)
            self.assertEqual(msg.get("jsonrpc"), "2.0")
        ids = [msg.get("id") for msg in parsed]
        self.assertEqual(ids, [1, 2, 3, 4, 5, 6, 7, 8, 9, None])
        self.assertEqual(proc.returncode, 0, proc.stderr.decode("utf-8", "replace"))

    def test_exits_cleanly_at_end_of_input(self):
        srv = self.server()
        srv.proc.stdin.close()
        self.assertEqual(srv.proc.wait(timeout=20), 0, srv.stderr)

    def assert_ended_cleanly(self, srv):
        code = srv.proc.wait(timeout=20)
        srv._err_thread.join(timeout=5)
        self.assertNotIn("Fatal Python error", srv.stderr)
        self.assertEqual(code, 0, srv.stderr)

    @unittest.skipIf(os.name == "nt", "Popen.send_signal cannot send SIGINT on Windows "
                                      "(only CTRL_C_EVENT, to a whole console group)")
    def test_ctrl_c_ends_the_server_cleanly(self):
        # The server has a thread blocked reading stdin at that moment.
        srv = self.server()
        self.assertEqual(srv.request("ping")["result"], {})
        srv.proc.send_signal(signal.SIGINT)
        self.assert_ended_cleanly(srv)

    @unittest.skipIf(os.name == "nt", "needs preexec_fn to close the child's fd 0 "
                                      "(not supported on Windows)")
    def test_no_stdin_at_all_ends_the_server_cleanly(self):
        proc = subprocess.run(list(support.SERVER_COMMAND), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=support.clean_env(), cwd=self.tmp, timeout=60,
                              preexec_fn=lambda: os.close(0))
        self.assertNotIn(b"Traceback", proc.stderr)
        self.assertEqual((proc.returncode, proc.stdout), (0, b""), proc.stderr)

    def test_a_client_that_stops_reading_ends_the_server_cleanly(self):
        srv = self.server()
        srv.proc.stdout.close()
        srv.send_raw(b'{"jsonrpc": "2.0", "id": 5, "method": "ping"}\n')
        self.assert_ended_cleanly(srv)

    def test_non_ascii_round_trip(self):
        srv = self.server()
        name = "重构认证模块"
        goal = "把 session 改成 JWT — ünïcødé ✓"
        title = "拆出服务层 🚀"
        self.write("src/认证.py", "x = '中文'\n")
        init = srv.ok("tc_init", root=self.root, name=name, goal=goal)
        self.assertEqual(init["name"], name)
        saved = srv.ok("tc_save", root=self.root, title=title, conclusion="结论：可行",
                       next="下一步：删旧函数")
        self.assertEqual(saved["title"], title)
        shown = srv.ok("tc_show", root=self.root)
        self.assertEqual([s["title"] for s in shown["steps"]], [title])
        resumed = srv.ok("tc_resume", root=self.root)
        self.assertEqual(resumed["goal"], goal)
        self.assertEqual(resumed["last"]["conclusion"], "结论：可行")
        self.assertEqual(resumed["next"], "下一步：删旧函数")
        self.assertIn(name, resumed["handoff"])
        step_file = os.path.join(self.store, "tasks", init["task_id"], "steps", "s0001.json")
        with open(step_file, encoding="utf-8") as fh:
            self.assertEqual(json.load(fh)["title"], title)
        # Raw frame bytes must be valid UTF-8 JSON that decodes to the same text.
        srv.send_raw((json.dumps({"jsonrpc": "2.0", "id": 99, "method": "tools/call",
                                  "params": {"name": "tc_show",
                                             "arguments": {"root": self.root}}},
                                 ensure_ascii=False) + "\n").encode("utf-8"))
        line = srv.proc.stdout.readline()
        reply = json.loads(line.decode("utf-8"))
        self.assertEqual(reply["id"], 99)
        self.assertEqual(reply["result"]["structuredContent"]["steps"][0]["title"], title)


if __name__ == "__main__":
    unittest.main()
