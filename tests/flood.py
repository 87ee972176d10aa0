"""A flood of unfinished connections from another local process (loopback only, bounded in
count and time): ``python -c FLOOD PORT COUNT SECONDS PAST [STOP_FILE]`` keeps COUNT
connections open that never finish their headers, reopening those the server closes, prints
``past`` once it has opened PAST, and at the end (after SECONDS, or once STOP_FILE exists)
the number it opened."""

FLOOD = r"""
import os, resource, select, socket, sys, time
port, count, seconds, past = (int(a) for a in sys.argv[1:5])
stop = sys.argv[5] if len(sys.argv) > 5 else None  # a file whose existence ends the flood
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 64), hard))
held, opened, end = {}, 0, time.monotonic() + seconds
while time.monotonic() < end and not (stop and os.path.exists(stop)):
    # keep `count` unfinished connections open, reopening those the server closes
    while len(held) < count and time.monotonic() < end:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=1)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
            held[s.fileno()] = s
            opened += 1
            if opened == past:
                print("past", flush=True)
        except OSError:
            break
    poll = select.poll()
    for fd in held:
        poll.register(fd, select.POLLIN)
    for fd, _ in poll.poll(50):  # readable: the server answered 503 or closed it
        held.pop(fd).close()
print(opened, flush=True)
"""
