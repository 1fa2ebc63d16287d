"""A model of the protocol in stream-receive-per-warp.patch (python3 this file: 20,000 random cases).

One channel: per ring r a sender writing its rows in order into ring_rows slots, as far as the rows it
was told are read allow; W receiving warps, warp w summing tokens w, w + W, ... once their rows are
written; after each token the warp publishes, per ring, the rows below the slowest warp's token (a
4-token lookahead, else nothing; all rows once none is left), in steps of publish_step. Checked: no
slot is overwritten before it is read, no published count covers an unread row, and no interleaving
stops before every token is summed.
"""
import random
def run(seed):
    rng = random.Random(seed)
    N = rng.randint(1, 120); R = rng.randint(1, 8); W = rng.choice([1,2,4,8,16,32]); ring = rng.randint(1, 40)
    LOOK = 4
    prob = [rng.choice([0.0, 0.05, 0.3, 0.7, 1.0]) for _ in range(R)]
    has = [[rng.random() < prob[r] for r in range(R)] for _ in range(N)]
    idx = [[None]*R for _ in range(N)]; cnt = [0]*R
    for t in range(N):
        for r in range(R):
            if has[t][r]: idx[t][r] = cnt[r]; cnt[r] += 1
    sent = [0]*R; told = [0]*R; published = [0]*R; consumed = [0]*R
    read = [set() for _ in range(R)]
    nxt = [min(w, N) for w in range(W)]
    step = max(1, min(W, ring // 2))
    cur = list(range(W))  # current token per warp
    def warp_step(w):
        t = cur[w]
        if t >= N: return False
        for r in range(R):
            if has[t][r] and not idx[t][r] < sent[r]: return False
        for r in range(R):
            if has[t][r]:
                k = idx[t][r]
                # safety: slot must still hold row k (not overwritten)
                assert sent[r] - k <= ring, ("overwritten", seed)
                read[r].add(k); consumed[r] = max(consumed[r], k+1)
        cur[w] = t + W; nxt[w] = min(t + W, N)
        below = min(nxt)
        for r in range(R):
            rows = -1
            for i in range(LOOK):
                if below + i < N and has[below+i][r]:
                    rows = idx[below+i][r]; break
            if rows < 0 and below + LOOK >= N: rows = consumed[r]
            if rows >= 0 and (rows >= published[r] + step or (below >= N and rows > published[r])) and published[r] < rows:
                # safety of the claim: every row < rows read
                assert all(k in read[r] for k in range(rows)), ("unsafe publish", seed)
                published[r] = rows; told[r] = max(told[r], rows)
        return True
    def send_step(r):
        if sent[r] < cnt[r] and sent[r] < told[r] + ring:
            sent[r] += 1; return True
        return False
    while True:
        moves = [("w", w) for w in range(W)] + [("s", r) for r in range(R)]
        rng.shuffle(moves)
        progressed = False
        for kind, i in moves:
            if (warp_step(i) if kind == "w" else send_step(i)):
                progressed = True; break
        if not progressed:
            done = all(c >= N for c in cur) and all(sent[r] == cnt[r] for r in range(R))
            assert done, ("deadlock", seed, N, R, W, ring, cur, sent, told, cnt)
            return
for s in range(20000): run(s)
print("ok")
