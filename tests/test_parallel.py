"""in_parallel: the helper that copies and hashes files on a few threads.

Restore and import roll back through their journal when a file fails; that
is only safe if no worker is still writing once the failure reaches the
caller. These tests pin that down, with the order of results and the
sequential path for short lists.
"""

import concurrent.futures
import sys
import threading
import time
import unittest

import support

sys.path.insert(0, support.SCRIPTS)
import tc  # noqa: E402


class Boom(Exception):
    pass


class InParallelTest(unittest.TestCase):

    def setUp(self):
        # Whatever this machine's default, these tests want the threads.
        self.saved = tc.WORK_THREADS
        tc.WORK_THREADS = 3

    def tearDown(self):
        tc.WORK_THREADS = self.saved

    def test_results_keep_the_order_of_the_items(self):
        def slow_square(n):
            time.sleep(0.001 * ((n * 7) % 5))
            return n * n

        self.assertEqual(tc.in_parallel(slow_square, range(60)), [n * n for n in range(60)])

    def test_one_work_thread_runs_everything_in_the_calling_thread(self):
        tc.WORK_THREADS = 1
        seen = []
        tc.in_parallel(lambda n: seen.append(threading.get_ident()), range(50))
        self.assertEqual(set(seen), {threading.get_ident()})

    def test_thread_count_from_the_environment_or_the_cores(self):
        self.assertEqual(tc.work_threads("6", 2), 6)
        self.assertEqual(tc.work_threads(None, 2), 1)
        self.assertEqual(tc.work_threads(None, 8), 4)
        self.assertEqual(tc.work_threads(None, 6), 3)
        for bad in ("0", "17", "many", ""):
            self.assertEqual(tc.work_threads(bad, 8), 4, bad)

    def test_short_lists_run_in_the_calling_thread(self):
        seen = []
        tc.in_parallel(lambda n: seen.append(threading.get_ident()), range(3))
        self.assertEqual(set(seen), {threading.get_ident()})

    def test_long_lists_use_other_threads(self):
        seen = set()
        lock = threading.Lock()

        def note(_n):
            with lock:
                seen.add(threading.get_ident())
            time.sleep(0.002)

        tc.in_parallel(note, range(40))
        self.assertNotIn(threading.get_ident(), seen)

    def test_a_failure_waits_for_every_started_call_and_starts_no_more(self):
        active, started, finished = [0], [], []
        lock = threading.Lock()

        def work(n):
            with lock:
                active[0] += 1
                started.append(n)
            try:
                if n == 5:
                    raise Boom("item 5")
                time.sleep(0.02)
                return n
            finally:
                with lock:
                    active[0] -= 1
                    finished.append(n)

        with self.assertRaises(Boom):
            tc.in_parallel(work, range(500))
        self.assertEqual(active[0], 0, "a worker was still running when the error arrived")
        self.assertEqual(sorted(started), sorted(finished))
        self.assertLess(len(started), 100, "calls kept starting after the failure")
        # The shared pool still works afterwards.
        self.assertEqual(tc.in_parallel(lambda n: n + 1, range(20)), list(range(1, 21)))

    def test_an_interrupt_while_waiting_still_waits_for_the_workers(self):
        # An exception that reaches the caller while it waits for a result
        # (Ctrl-C in the server) must not leave that call running.
        active = [0]
        lock = threading.Lock()
        release = threading.Event()

        def work(n):
            with lock:
                active[0] += 1
            try:
                if n == 0:
                    release.wait(5)
                return n
            finally:
                with lock:
                    active[0] -= 1

        def interrupt():
            time.sleep(0.1)
            release.set()

        original = concurrent.futures.Future.result
        calls = [0]

        def result_then_interrupt(future, timeout=None):
            calls[0] += 1
            if calls[0] == 1:
                threading.Thread(target=interrupt).start()
                raise KeyboardInterrupt
            return original(future, timeout)

        concurrent.futures.Future.result = result_then_interrupt
        try:
            with self.assertRaises(KeyboardInterrupt):
                tc.in_parallel(work, range(8))
        finally:
            concurrent.futures.Future.result = original
        self.assertEqual(active[0], 0, "a worker was still running after the interrupt")

    def test_nested_calls_run_in_the_worker_instead_of_waiting_on_the_pool(self):
        def outer(n):
            return sum(tc.in_parallel(lambda m: m * n, range(10)))

        done = []
        thread = threading.Thread(target=lambda: done.append(tc.in_parallel(outer, range(12))))
        thread.start()
        thread.join(10)
        self.assertFalse(thread.is_alive(), "nested in_parallel deadlocked")
        self.assertEqual(done, [[45 * n for n in range(12)]])

    def test_the_earliest_failing_item_is_the_one_raised(self):
        def work(n):
            if n in (3, 30):
                time.sleep(0.03 if n == 3 else 0)
                raise Boom("item %d" % n)
            return n

        with self.assertRaises(Boom) as caught:
            tc.in_parallel(work, range(40))
        self.assertEqual(str(caught.exception), "item 3")


if __name__ == "__main__":
    unittest.main()
