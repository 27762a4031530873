"""Where the space goes and keeping a store to a budget: tc_compress's
dry_run and usage, TC_STORE_BUDGET, and `tc-mcp usage`.

Black-box: a real server over stdio, the command line as a subprocess, the
store's files measured by the test itself.
"""

import json
import os
import subprocess
import sys

import support
from support import SERVER, clean_env, read, write

CLI = (sys.executable, "-S", SERVER)
CHURN = 5000  # bytes of the file that changes before every capture


def store_bytes(store):
    """The bytes of every file in the store, as the test sees them."""
    total = 0
    for dirpath, _dirs, names in os.walk(store):
        total += sum(os.lstat(os.path.join(dirpath, name)).st_size for name in names)
    return total


def payload_bytes(store):
    return sum(os.path.getsize(os.path.join(store, "payload", sha[:2], sha))
               for sha in support.stored_shas(store))


class BudgetTest(support.WorkspaceTest):
    def usage(self, env):
        proc = subprocess.run(list(CLI) + ["usage", "--root", self.root, "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env(env), timeout=60, encoding="utf-8")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        return json.loads(proc.stdout)["usage"]

    def test_fifty_captures_of_a_churning_file_stay_within_the_budget(self):
        budget = 200 * 1024
        env = {"TC_STORE_BUDGET": "200K"}
        srv = self.server(env)
        srv.ok("tc_init", root=self.root, name="churn")
        saved = {}
        for round_no in range(50):
            write(self.root, "data.bin", os.urandom(CHURN))
            self.assertTrue(srv.ok("tc_capture", root=self.root,
                                   label="round %d" % round_no)["captured"])
            if round_no % 10 == 9:
                index = srv.ok("tc_save", root=self.root, title="round %d" % round_no)["index"]
                saved[index] = read(self.root, "data.bin")
            self.assertLessEqual(store_bytes(self.store), budget, round_no)
        self.assertGreater(50 * CHURN, budget)  # kept whole, the captures alone would not fit
        drifts = srv.ok("tc_show", root=self.root, include_drift=True, limit=200)["drifts"]
        reclaimed = [d for d in drifts if d["compressed"]]
        self.assertTrue(reclaimed)
        self.assertTrue(all(not d["compressed"] for d in drifts[-20:]))
        newest = drifts[-1]
        for index, data in sorted(saved.items()):
            srv.ok("tc_restore", root=self.root, index=index, apply=True)
            self.assertEqual(read(self.root, "data.bin"), data, index)
        srv.ok("tc_restore", root=self.root, drift_id=newest["id"], apply=True)
        self.assertTrue(srv.ok("tc_resume", root=self.root)["health"]["ok"])
        usage = self.usage(env)
        self.assertEqual(usage["budget"]["bytes"], budget)
        self.assertFalse(usage["budget"]["over"])
        self.assertGreaterEqual(usage["budget"]["reclaimed_records"], len(reclaimed))
        self.assertGreater(usage["budget"]["reclaimed_bytes"], 0)
        with open(os.path.join(self.store, "server.log"), encoding="utf-8") as fh:
            self.assertIn("TC_STORE_BUDGET (204800 bytes): reclaimed the content of", fh.read())
        text = subprocess.run(list(CLI) + ["usage", "--root", self.root],
                              stdout=subprocess.PIPE, env=clean_env(env), timeout=60,
                              encoding="utf-8").stdout
        self.assertIn("budget (TC_STORE_BUDGET): 200.0 KB, kept; reclaimed so far: %d drift "
                      "record(s)" % usage["budget"]["reclaimed_records"], text)

    def test_steps_over_the_budget_delete_nothing_and_health_says_so(self):
        env = {"TC_STORE_BUDGET": "2K"}
        srv = self.server(env)
        write(self.root, "big.txt", "x" * 5000)
        srv.ok("tc_init", root=self.root, name="too big")
        srv.ok("tc_save", root=self.root, title="one")
        write(self.root, "big.txt", "y" * 5000)
        srv.ok("tc_capture", root=self.root)
        write(self.root, "big.txt", "z" * 5000)
        shas = support.stored_shas(self.store)
        srv.ok("tc_capture", root=self.root)
        self.assertLess(set(shas), set(support.stored_shas(self.store)))  # nothing deleted
        health = srv.ok("tc_resume", root=self.root)["health"]
        self.assertFalse(health["ok"])
        self.assertTrue(any("over TC_STORE_BUDGET (2048 bytes)" in error
                            and "no more was reclaimed" in error for error in health["errors"]),
                        health)
        self.assertTrue(self.usage(env)["budget"]["over"])
        # Without the budget there is nothing to say.
        self.assertTrue(self.server().ok("tc_resume", root=self.root)["health"]["ok"])

    def test_a_budget_the_newest_records_outgrow_still_reclaims_the_older_ones(self):
        # The newest 20 records of a 20 KB churning file need 400 KB: more
        # than the budget, while the steps alone need little.
        env = {"TC_STORE_BUDGET": "250K"}
        srv = self.server(env)
        srv.ok("tc_init", root=self.root, name="small budget")
        srv.ok("tc_save", root=self.root, title="one")
        for round_no in range(30):
            write(self.root, "data.bin", os.urandom(20 * 1024))
            srv.ok("tc_capture", root=self.root)
        drifts = srv.ok("tc_show", root=self.root, include_drift=True, limit=200)["drifts"]
        self.assertEqual([d["id"] for d in drifts if d["compressed"]],
                         [d["id"] for d in drifts[1:11]], "the ten oldest captures go")
        # Their content is gone: kept whole, the 30 captures alone hold 600 KB.
        self.assertLess(store_bytes(self.store), 500 * 1024)
        health = srv.ok("tc_resume", root=self.root)["health"]
        self.assertTrue(any("over TC_STORE_BUDGET" in error for error in health["errors"]),
                        health)
        self.assertTrue(self.usage(env)["budget"]["over"])

    def test_budget_values(self):
        self.server().ok("tc_init", root=self.root, name="values")
        for value, expected in (("123", 123), ("10K", 10240), ("3m", 3 << 20), ("1G", 1 << 30),
                                ("64KB", 65536), ("off", None), ("", None)):
            self.assertEqual(self.usage({"TC_STORE_BUDGET": value})["budget"]["bytes"],
                             expected, value)
        proc = subprocess.run(list(CLI), input=b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n',
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env({"TC_STORE_BUDGET": "lots"}), timeout=30)
        self.assertIn("TC_STORE_BUDGET='lots' is not a size in bytes", proc.stderr.decode())
        self.assertEqual(json.loads(proc.stdout)["result"], {})


class UsageTest(support.WorkspaceTest):
    def test_dry_run_reports_what_compress_then_frees_and_deletes_nothing(self):
        srv = self.server()
        write(self.root, "keep.txt", "kept by the step\n")
        srv.ok("tc_init", root=self.root, name="usage")
        srv.ok("tc_save", root=self.root, title="one")
        for round_no in range(6):
            write(self.root, "draft.txt", "draft %d\n" % round_no * 100)
            srv.ok("tc_capture", root=self.root)
        shas = support.stored_shas(self.store)
        dry = srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=1, dry_run=True)
        self.assertTrue(dry["dry_run"])
        self.assertEqual(support.stored_shas(self.store), shas)
        usage = dry["usage"]
        self.assertEqual(usage["total_bytes"], store_bytes(self.store))
        self.assertEqual(usage["content_bytes"], payload_bytes(self.store))
        self.assertEqual(usage["content_files"], len(shas))
        # Each drift's copy of draft.txt but the newest is held by drift records only.
        self.assertEqual(usage["drift_only_bytes"], sum(
            len(("draft %d\n" % n * 100).encode()) for n in range(5)))
        [task] = usage["tasks"]
        self.assertEqual((task["steps"], task["drifts"], task["root"]), (1, 7, self.root))
        self.assertEqual(task["content_bytes"], usage["content_bytes"])
        self.assertEqual(usage["freed_at_keep_seconds_0"], dry["bytes_freed"])
        done = srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=1)
        self.assertFalse(done["dry_run"])
        self.assertEqual(done["bytes_freed"], dry["bytes_freed"])
        self.assertEqual((done["converted"], done["eligible"]), (dry["converted"], dry["eligible"]))
        self.assertEqual(payload_bytes(self.store), usage["content_bytes"] - dry["bytes_freed"])
        self.assertEqual(done["usage"]["drift_only_bytes"], 0)
        self.assertEqual(done["usage"]["freed_at_keep_seconds_0"], 0)


if __name__ == "__main__":
    import unittest
    unittest.main()
