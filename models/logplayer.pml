/*
 * LogPlayer (Roohitavaf et al., "LogPlayer: Fault-tolerant Exactly-once Delivery using gRPC
 * Asynchronous Streaming"): the paper's PlusCal model (Figures 3-6) in Promela, widened from one
 * target to T targets. models/README.md maps each process to tidings' code and says what is
 * checked and what is not.
 *
 * Parameters (spin -DN=4 -DT=2 -DF=2 ...):
 *   N  WAL entries; every entry carries mutations for every target (the paper's model too).
 *   T  targets.
 *   F  failures of each target; each is followed by the target's return.
 *   FT how many of the targets fail (the first FT; default all).
 * LogPlayer restarts are the initial state: each target's last acknowledged index starts anywhere
 * in 0..N (what the target stored before the player crashed), and the main fetcher starts at
 * min(last_ack) + 1 (Algorithm 5).
 *
 * Variants:
 *   -DNO_TERMS   the paper's first draft, without terms: spin finds a duplicate delivery.
 *
 * One PlusCal label is one atomic step here: `atomic { ... }` where the label's statements
 * take a lock or read several variables, a plain statement otherwise.
 */

#ifndef N
#define N 3
#endif
#ifndef T
#define T 2
#endif
#ifndef F
#define F 1
#endif
#ifndef FT
#define FT T
#endif

/* Target queue states: Normal, Recovery Fetching, Fetching Completed, Suspended. */
mtype = { QN, QRF, QFC, QS };

mtype state[T];
chan normal[T] = [2 * N] of { byte };   /* entries of the main stream */
chan catchup[T] = [2 * N] of { byte };  /* entries of a recovery stream */
chan cq[T] = [2 * N] of { byte };       /* entries written to a target's stream, not yet completed */
chan batch = [2 * N] of { byte };       /* current_batch: used under L_s only */
byte front[T];
byte term[T];
bool wready[T];                         /* write_status = ready */
byte last_ack[T];                       /* what the target has applied (durable) */
byte current_index;                     /* last index the main stream dispatched */
bool L_d = true;                        /* dispatcher lock */
bool L_s = true;                        /* sendNext lock */
bool L_q[T];                            /* one lock per target queue */
bool run_recovery[T];                   /* signal to a target's recovery fetcher */
byte r_s_index[T];
byte r_e_index[T];
byte ndone;                             /* targets that have acknowledged entry N */

/* -DCOARSE: each operation is one atomic step, as on tidings' single asyncio event loop (code
 * between two awaits runs alone), instead of the paper's lock-by-lock steps. */
#ifdef COARSE
#define STEP(x) atomic { x }
#else
#define STEP(x) x
#endif

#ifdef NO_TERMS
#define TERM_OK(t, pterm) true
#else
#define TERM_OK(t, pterm) (term[t] == pterm)
#endif

/* ---- Target queue (Algorithm 1, Figure 4) ---- */

inline get_front(t) {
  if
  :: (state[t] == QRF || state[t] == QFC) && len(catchup[t]) > 0 -> catchup[t]?<front[t]>
  :: state[t] == QFC && len(catchup[t]) == 0 ->
       state[t] = QN;
       if
       :: len(normal[t]) > 0 -> normal[t]?<front[t]>
       :: else -> front[t] = 0
       fi
  :: state[t] == QN && len(normal[t]) > 0 -> normal[t]?<front[t]>
  :: else -> front[t] = 0
  fi
}

inline pop(t) {
  if
  :: (state[t] == QRF || state[t] == QFC) && len(catchup[t]) > 0 ->
       catchup[t]?_;
       if
       :: state[t] == QFC && len(catchup[t]) == 0 -> state[t] = QN
       :: else -> skip
       fi
  :: state[t] == QN && len(normal[t]) > 0 -> normal[t]?_
  :: else -> skip
  fi
}

inline drain(c) {
  do
  :: len(c) > 0 -> c?_
  :: else -> break
  od
}

inline suspend(t) {
  atomic {
    L_q[t] -> L_q[t] = false;
    state[t] = QS;
    drain(normal[t]);
    drain(catchup[t])
  }
  L_q[t] = true
}

inline push(t, idx, is_normal, pterm) {
  atomic {
    L_q[t] -> L_q[t] = false;
    if
    :: state[t] != QS && (is_normal || TERM_OK(t, pterm)) ->
         if
         :: is_normal -> normal[t]!idx
         :: else -> catchup[t]!idx
         fi
    :: else -> skip
    fi
  }
  L_q[t] = true
}

/* Algorithm 2: pops entries from the front into the batch, under the queue's lock. */
inline next_batch(t) {
  atomic { L_q[t] -> L_q[t] = false; drain(batch) }
  atomic { get_front(t) }
  do
  :: front[t] != 0 ->
       batch!front[t];
       atomic { pop(t) }
       atomic { get_front(t) }
  :: else -> break
  od;
  L_q[t] = true
}

/* Algorithm 3's sendNext: at most one write in flight per stream. */
inline send_next(t) {
  atomic { L_s -> L_s = false }
  if
  :: wready[t] ->
       next_batch(t);
       atomic {
         if
         :: len(batch) > 0 && state[t] != QS ->
              do
              :: len(batch) > 0 -> batch?tmp; cq[t]!tmp
              :: else -> break
              od;
              wready[t] = false
         :: else -> skip
         fi
       }
  :: else -> skip
  fi;
  L_s = true
}

inline fetching_completed(t, fterm) {
  if
  :: atomic { state[t] == QRF && TERM_OK(t, fterm) && len(catchup[t]) == 0 -> state[t] = QN };
       send_next(t)
  :: atomic { state[t] == QRF && TERM_OK(t, fterm) && len(catchup[t]) > 0 -> state[t] = QFC }
  :: else -> skip
  fi
}

/* ---- Dispatcher (Algorithm 3, Figure 5) ---- */

inline dispatch_main(idx) {
  atomic { L_d -> L_d = false }
  t = 0;
  do
  :: t < T ->
       if
       :: last_ack[t] < idx ->
            push(t, idx, true, 0);
            send_next(t)
       :: else -> skip
       fi;
       t++
  :: else -> break
  od;
  current_index = idx;
  L_d = true
}

inline dispatch_recovery(t, idx, rterm) {
  atomic { L_d -> L_d = false }
  if
  :: last_ack[t] < idx ->
       push(t, idx, false, rterm);
       send_next(t)
  :: else -> skip
  fi;
  L_d = true
}

/* ---- Processes ---- */

/* The main fetcher: from min(last_ack) + 1 to N, each entry to every target. */
proctype MainFetcher(byte start) {
  byte idx = start;
  byte t;
  byte tmp;
  do
  :: idx <= N -> STEP(dispatch_main(idx)); idx++
  :: else -> break
  od
}

/* A target's recovery fetcher: r_s_index .. r_e_index into the catch-up queue, in the term it
 * was started for. */
proctype RecoveryFetcher(byte t) {
  byte counter;
  byte rterm;
  byte tmp;
  do
  :: last_ack[t] == N -> break
  :: else ->
       atomic {
         (run_recovery[t] || last_ack[t] == N);
         if
         :: last_ack[t] == N -> goto done
         :: else -> run_recovery[t] = false; rterm = term[t]; counter = r_s_index[t]
         fi
       }
       do
       :: counter <= r_e_index[t] && state[t] != QS && TERM_OK(t, rterm) ->
            STEP(dispatch_recovery(t, counter, rterm));
            counter++
       :: else -> break
       od;
       if
       :: counter > r_e_index[t] -> STEP(fetching_completed(t, rterm))
       :: else -> skip
       fi
  od;
done:
  skip
}

/* The completion queue consumer (Algorithm 4), one per target: a write completes, the target
 * has applied its entry; the safety assertion is here. */
proctype CompletionQueue(byte t) {
  byte idx;
  byte tmp;
  do
  :: last_ack[t] == N -> break
  :: else ->
       len(cq[t]) > 0;
       atomic {
         if
         :: state[t] != QS && len(cq[t]) > 0 ->
              cq[t]?idx;
              assert(idx == last_ack[t] + 1);  /* in order, no duplicate, none skipped */
              last_ack[t] = idx;
              if
              :: idx == N -> ndone++
              :: else -> skip
              fi
         :: state[t] == QS && len(cq[t]) > 0 -> cq[t]?_
         :: else -> skip
         fi;
         wready[t] = true
       }
       STEP(send_next(t))
  od
}

/* A target fails (its stream breaks: in-flight writes are lost) and returns, F times
 * (Figure 6, Algorithm 5). */
proctype TargetFailureRecovery(byte t) {
  byte n = 1;
  do
  :: n <= 2 * F && last_ack[t] < N ->
       if
       :: state[t] != QS && n < 2 * F ->
            STEP(state[t] = QS; suspend(t); atomic { drain(cq[t]); run_recovery[t] = false })
       :: state[t] == QS ->
            atomic { L_d && L_s -> L_d = false; L_s = false }
            atomic {
              term[t]++;
              state[t] = QRF;
              wready[t] = true;
              if
              :: last_ack[t] < current_index ->
                   r_s_index[t] = last_ack[t] + 1;
                   r_e_index[t] = current_index;
                   run_recovery[t] = true
              :: else -> state[t] = QN
              fi
            }
            atomic { L_d = true; L_s = true }
       :: else -> skip
       fi;
       n++
  :: else -> break
  od
}

init {
  byte t;
  byte start;
  atomic {
    t = 0;
    start = N;
    do
    :: t < T ->
         state[t] = QN;
         wready[t] = true;
         L_q[t] = true;
         /* LogPlayer restart: the target already applied 0..N entries. */
         do
         :: last_ack[t] < N -> last_ack[t]++
         :: break
         od;
         if
         :: last_ack[t] == N -> ndone++
         :: else -> skip
         fi;
         if
         :: last_ack[t] < start -> start = last_ack[t]
         :: else -> skip
         fi;
         t++
    :: else -> break
    od;
    current_index = start;
    t = 0;
    run MainFetcher(start + 1);
    do
    :: t < T ->
         run RecoveryFetcher(t);
         run CompletionQueue(t);
         if
         :: t < FT -> run TargetFailureRecovery(t)
         :: else -> skip
         fi;
         t++
    :: else -> break
    od
  }
}

/* Liveness: once the (bounded) faults stop, every target acknowledges every entry. */
ltl delivered { <> (ndone == T) }
