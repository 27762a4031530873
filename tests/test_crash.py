"""SIGKILL at random moments during tc_save and tc_restore.

The server is killed with no chance to clean up, at a seeded random delay
after a request was sent. Whatever the moment, the next server must read the
store correctly: health ok, every JSON record parses, every payload matches
its hash, every acknowledged step restores byte-exact, and a restore that was
cut off leaves the workspace either exactly as it was before the restore
(unsaved edits included) or exactly at the restore's target, never a mix.

Set CRASH_SEED to replay a run; the seed in use is part of every failure
message.
"""

import hashlib
import json
import os
import time
import unittest

from support import (SeededTest, fill_workspace, kill_and_collect, mutate, send, snapshot,
                     store_problems, stored_shas, unnamed_payloads, write)


class CrashTest(SeededTest):

    def save_args(self, title):
        return dict(root=self.root, title=title, conclusion="reached " + title,
                    next="after " + title)

    def check_store(self, srv):
        resume = srv.ok("tc_resume", root=self.root)
        self.assertTrue(resume["health"]["ok"], (self.seed_note, resume["health"]))
        self.assertEqual(resume["health"]["errors"], [], self.seed_note)
        self.assertEqual(store_problems(self.store), [], self.seed_note)
        return resume

    def step_indices(self, srv):
        shown = srv.ok("tc_show", root=self.root, limit=200)
        return [step["index"] for step in shown["steps"]]

    def newest_drift(self, srv):
        shown = srv.ok("tc_show", root=self.root, include_drift=True, limit=200)
        ids = []
        for drift in shown["drifts"]:
            for key in ("drift_id", "id"):
                if isinstance(drift.get(key), str):
                    ids.append(drift[key])
                    break
        return max(ids) if ids else None


class KillDuringInit(CrashTest):

    def test_sigkill_during_init_leaves_a_usable_store(self):
        fill_workspace(self.root, self.rng, files=200)
        first = self.server()
        first.ok("tc_init", root=self.root, name="first task")
        first.ok("tc_save", **self.save_args("kept"))
        # How long an init of this much takes, measured on a twin workspace.
        twin = os.path.join(self.tmp, "twin")
        os.makedirs(twin)
        fill_workspace(twin, self.rng, files=200)
        started = time.monotonic()
        first.ok("tc_init", root=twin, name="timing")
        took = max(time.monotonic() - started, 0.05)
        for round_no in range(3):
            srv = self.server()
            request_id = send(srv, "tc_init", root=self.root, name="second %d" % round_no)
            time.sleep(self.rng.uniform(0, took))
            answer = kill_and_collect(srv, request_id)
            note = "%s round %d" % (self.seed_note, round_no)
            after = self.server()
            resume = self.check_store(after)
            tasks = os.listdir(os.path.join(self.store, "tasks"))
            for task_id in tasks:  # every task directory left is a whole task
                self.assertTrue(os.path.isfile(os.path.join(self.store, "tasks", task_id,
                                                            "state.json")), (note, tasks))
            if answer is None:
                # Either the old task is still the active one, or the new one
                # finished before the kill; never a half-made task.
                self.assertIn(resume["active_task"], tasks, note)
            self.assertEqual(after.ok("tc_save", **self.save_args("after %d" % round_no))
                             ["task_id"], resume["active_task"], note)

        # The narrow window itself: an init that died after its first record
        # but before its state, as a dead writer leaves it (marker included).
        orphan = os.path.join(self.store, "tasks", "dead-init-0a0b0c")
        write(orphan, "manifest/m0001.json", b'{"n": 1, "full": true, "depth": 0, "files": {}}')
        write(self.store, "writing", b"")
        after = self.server()
        self.check_store(after)
        self.assertFalse(os.path.exists(orphan), "a half-made task directory was kept")


class KillDuringSave(CrashTest):

    def test_acknowledged_steps_survive_sigkill_during_save(self):
        names = fill_workspace(self.root, self.rng)
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="crash during save")
        first = srv.ok("tc_save", **self.save_args("baseline"))
        self.assertEqual(first["index"], 1)
        known = {1: snapshot(self.root)}
        # A save with fresh content to store, timed for the random delays.
        mutate(self.root, self.rng, names, "timed")
        started = time.monotonic()
        second = srv.ok("tc_save", **self.save_args("timed"))
        took = max(time.monotonic() - started, 0.05)
        self.assertEqual(second["index"], 2)
        known[2] = snapshot(self.root)
        acked = [1, 2]

        for round_no in range(5):
            mutate(self.root, self.rng, names, "r%d" % round_no)
            state = snapshot(self.root)
            request_id = send(srv, "tc_save", **self.save_args("round %d" % round_no))
            delay = self.rng.uniform(0, took * 1.5)
            time.sleep(delay)
            answer = kill_and_collect(srv, request_id)
            note = "%s round %d delay %.3f" % (self.seed_note, round_no, delay)

            srv = self.server()
            self.check_store(srv)
            indices = self.step_indices(srv)
            self.assertEqual(len(indices), len(set(indices)), note)
            self.assertTrue(set(acked) <= set(indices), (note, acked, indices))
            highest = max(known)
            if answer is not None:
                self.assertNotIn("error", answer, note)
                index = answer["result"]["structuredContent"]["index"]
                self.assertGreater(index, highest, "%s: step %d was already listed by tc_show "
                                   "and got reused by a new save" % (note, index))
                self.assertIn(index, indices, note)
                acked.append(index)
                known[index] = state
            # A save cut off after its step record landed is a step too, and
            # it must hold exactly the files of that moment.
            unknown = set(indices) - set(known)
            self.assertLessEqual(len(unknown), 1, (note, indices))
            for index in unknown:
                self.assertGreater(index, highest, note)
                shown = srv.ok("tc_show", root=self.root, index=index)
                self.assertEqual(shown["steps"][0]["title"], "round %d" % round_no, note)
                preview = srv.call("tc_restore", root=self.root, index=index)
                self.assertFalse(preview.is_error, "%s: tc_show lists step %d but tc_restore "
                                 "says: %s" % (note, index, preview.text))
                known[index] = state

        # One more ordinary save after all that: a fresh, higher number.
        mutate(self.root, self.rng, names, "final")
        final = srv.ok("tc_save", **self.save_args("after the crashes"))
        self.assertGreater(final["index"], max(known))
        known[final["index"]] = snapshot(self.root)
        srv.close()

        srv = self.server()
        self.check_store(srv)
        for index in sorted(known):
            res = srv.ok("tc_restore", root=self.root, index=index, apply=True)
            self.assertTrue(res["applied"])
            self.assertTrue(snapshot(self.root) == known[index],
                            "%s: step %d does not restore byte-exact" % (self.seed_note, index))
        self.check_store(srv)


class KilledSaveContent(CrashTest):

    def test_content_a_killed_save_left_unnamed_is_reclaimed_by_compress(self):
        names = fill_workspace(self.root, self.rng, files=600)
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="killed save content")
        srv.ok("tc_save", **self.save_args("baseline"))
        known = snapshot(self.root)
        before = set(stored_shas(self.store))
        for rel in names:  # every file gets content the store has never seen
            write(self.root, rel, self.rng.randbytes(self.rng.randrange(2000, 9000)))
        request_id = send(srv, "tc_save", **self.save_args("killed"))
        deadline = time.monotonic() + 30
        while len(set(stored_shas(self.store)) - before) < 20 and time.monotonic() < deadline:
            time.sleep(0.001)
        answer = kill_and_collect(srv, request_id)
        self.assertIsNone(answer, "the save finished before the kill; nothing to test")
        self.assertGreaterEqual(len(unnamed_payloads(self.store)), 20, "nothing was left")

        srv = self.server()
        # The first lock drops content cut short by the dead writer; the rest
        # is whole, and the default compress keeps it (7 days).
        kept = srv.ok("tc_compress", root=self.root)
        self.assertEqual(kept["unreferenced"], 0, kept)
        left = unnamed_payloads(self.store)
        self.assertGreaterEqual(len(left), 19, "the kill left no unnamed content")
        sizes = sum(os.path.getsize(path) for sha, path in stored_shas(self.store).items()
                    if sha in left)
        res = srv.ok("tc_compress", root=self.root, keep_seconds=0)
        self.assertEqual(res["unreferenced"], len(left), res)
        self.assertEqual(res["bytes_freed"], sizes, res)
        self.assertEqual(unnamed_payloads(self.store), [])
        self.assertTrue(before <= set(stored_shas(self.store)), "named content was removed")
        self.check_store(srv)
        srv.ok("tc_restore", root=self.root, index=1, apply=True)
        self.assertTrue(snapshot(self.root) == known, "step 1 does not restore byte-exact")
        # The save goes through now, with its content stored again.
        for rel in names[:50]:
            write(self.root, rel, self.rng.randbytes(3000))
        again = srv.ok("tc_save", **self.save_args("after the kill"))
        state = snapshot(self.root)
        srv.ok("tc_restore", root=self.root, index=1, apply=True)
        srv.ok("tc_restore", root=self.root, index=again["index"], apply=True)
        self.assertTrue(snapshot(self.root) == state)
        self.check_store(srv)


class TornRecords(CrashTest):

    def test_records_beyond_the_state_that_never_reached_the_disk_are_dropped(self):
        # What a power cut can leave after a save's records were written but
        # before they were flushed and the state pointed at them: names whose
        # bytes are missing or cut short, and the store's "writing" marker.
        write(self.root, "a.txt", b"one\n")
        srv = self.server()
        task = srv.ok("tc_init", root=self.root, name="torn")["task_id"]
        srv.ok("tc_save", **self.save_args("one"))
        write(self.root, "a.txt", b"two\n")
        srv.ok("tc_save", **self.save_args("two"))
        srv.close()
        task_dir = os.path.join(self.store, "tasks", task)
        with open(os.path.join(task_dir, "state.json"), encoding="utf-8") as fh:
            state = json.load(fh)
        torn = [os.path.join(task_dir, "steps", "s%04d.json" % (state["last_step"] + 1)),
                os.path.join(task_dir, "drifts", "d%04d.json" % (state["last_drift"] + 1)),
                os.path.join(task_dir, "manifest", "m%04d.json" % (state["last_manifest"] + 1))]
        for path, data in zip(torn, (b"", b'{"index": 3, "tit', b"\0" * 64)):
            with open(path, "wb") as fh:
                fh.write(data)
        with open(os.path.join(self.store, "writing"), "wb"):
            pass

        srv = self.server()
        write(self.root, "a.txt", b"three\n")
        third = srv.ok("tc_save", **self.save_args("three"))
        self.assertEqual(third["index"], 3)
        self.assertEqual(self.step_indices(srv), [1, 2, 3])
        self.check_store(srv)
        for path in torn:
            with open(path, "rb") as fh:
                json.loads(fh.read())  # the name now holds a whole record of the new save
        srv.ok("tc_restore", root=self.root, index=2, apply=True)
        with open(os.path.join(self.root, "a.txt"), "rb") as fh:
            self.assertEqual(fh.read(), b"two\n")

    def test_content_cut_short_by_a_dead_writer_is_never_relied_on(self):
        # Stored content is written straight to its final name. A writer
        # killed midway leaves it short, with the "writing" marker; the next
        # server must not take that file for the content its name promises.
        write(self.root, "a.txt", b"one\n")
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="short payload")
        srv.ok("tc_save", **self.save_args("one"))
        srv.close()
        coming = b"the content of the next save\n" * 50
        sha = hashlib.sha256(coming).hexdigest()
        short = os.path.join(self.store, "payload", sha[:2], sha)
        write(self.store, "writing", b"")
        write(os.path.dirname(short), sha, coming[:100])
        older = os.path.join(self.store, "payload", "ab", "ab" + "0" * 62)
        write(os.path.dirname(older), os.path.basename(older), b"not this content")
        os.utime(older, ns=(1, 1))  # written long before the marker: not looked at

        srv = self.server()
        write(self.root, "a.txt", coming)
        srv.ok("tc_save", **self.save_args("two"))
        with open(short, "rb") as fh:
            self.assertEqual(fh.read(), coming, "the short copy was kept")
        self.assertTrue(os.path.exists(older))
        os.remove(older)
        self.check_store(srv)
        write(self.root, "a.txt", b"three\n")
        srv.ok("tc_restore", root=self.root, index=2, apply=True)
        with open(os.path.join(self.root, "a.txt"), "rb") as fh:
            self.assertEqual(fh.read(), coming)


class KillDuringRestore(CrashTest):

    def test_sigkill_during_restore_rolls_back_or_completes(self):
        names = fill_workspace(self.root, self.rng)
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="crash during restore")
        srv.ok("tc_save", **self.save_args("one"))
        steps = {1: snapshot(self.root)}
        mutate(self.root, self.rng, names, "two", share=0.8)
        srv.ok("tc_save", **self.save_args("two"))
        steps[2] = snapshot(self.root)

        # One acknowledged restore and its undo, timed for the random delays.
        mutate(self.root, self.rng, names, "calibrate", share=0.1)
        before = snapshot(self.root)
        started = time.monotonic()
        done = srv.ok("tc_restore", root=self.root, index=1, apply=True)
        took = max(time.monotonic() - started, 0.05)
        self.assertEqual(snapshot(self.root), steps[1], self.seed_note)
        srv.ok("tc_restore", root=self.root, drift_id=done["recovered"], apply=True)
        self.assertEqual(snapshot(self.root), before, self.seed_note)
        base = 2
        recovery = took / 2  # how long a new server takes to roll a restore back

        for round_no in range(4):
            target = 1 if base == 2 else 2
            mutate(self.root, self.rng, names, "u%d" % round_no, share=0.1)
            write(self.root, "unsaved-%d.txt" % round_no, os.urandom(64), mode=0o600)
            for i in range(250):
                write(self.root, "scratch/r%d/%03d.txt" % (round_no, i), os.urandom(40))
            before = snapshot(self.root)
            request_id = send(srv, "tc_restore", root=self.root, index=target, apply=True)
            delay = self.rng.uniform(0, took * 1.5)
            time.sleep(delay)
            answer = kill_and_collect(srv, request_id)
            note = "%s round %d delay %.3f" % (self.seed_note, round_no, delay)

            if round_no % 3 != 2:
                # The next server dies too, somewhere inside its own clean-up
                # of the abandoned restore: the one after it must finish it.
                srv = self.server()
                second_id = send(srv, "tc_show", root=self.root)
                second_delay = self.rng.uniform(0, recovery * 1.2)
                time.sleep(second_delay)
                kill_and_collect(srv, second_id)
                note += " then %.3f" % second_delay

            srv = self.server()
            started = time.monotonic()
            shown = srv.call("tc_show", root=self.root)
            recovery = max(recovery, time.monotonic() - started)
            self.assertFalse(shown.is_error, (note, shown.text))
            after = snapshot(self.root)
            if answer is not None:
                self.assertNotIn("error", answer, note)
                self.assertTrue(after == steps[target],
                                note + ": an acknowledged restore was undone")
            elif after == before:
                pass
            else:
                self.assertTrue(after == steps[target], "%s: workspace is a mix (%d files "
                                "differ from before, %d from the target)" % (
                                    note, differing(after, before), differing(after, steps[target])))
            self.check_store(srv)

            if after == steps[target]:
                # Completed: the recovered record must undo it, unsaved edits included.
                recovered = (answer["result"]["structuredContent"]["recovered"]
                             if answer is not None else self.newest_drift(srv))
                self.assertIsNotNone(recovered, note)
                srv.ok("tc_restore", root=self.root, drift_id=recovered, apply=True)
                self.assertTrue(snapshot(self.root) == before, note + ": undo lost bytes")
                srv.ok("tc_restore", root=self.root, index=target, apply=True)
                base = target

        srv.close()
        srv = self.server()
        self.check_store(srv)
        self.assertEqual(sorted(self.step_indices(srv)), [1, 2], self.seed_note)
        for index in (1, 2):
            srv.ok("tc_restore", root=self.root, index=index, apply=True)
            self.assertTrue(snapshot(self.root) == steps[index],
                            "%s: step %d does not restore byte-exact" % (self.seed_note, index))


def differing(one, other):
    keys = set(one) | set(other)
    return sum(1 for key in keys if one.get(key) != other.get(key))


if __name__ == "__main__":
    unittest.main()
