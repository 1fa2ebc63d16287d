// The numbers the kernels report to the host by: the slots of the host record, which kernel, what a
// failed wait waited for, the wait profile's phases and the low-latency
// timeline's columns. This header is their one definition: the extension exports the tables at the end of
// this file (csrc/bindings.cpp) and Python reads them there by name (moe_ep.backends.peers.KernelEnums);
// where no extension is built, Python reads this file itself (moe_ep/backends/reports.py). Free of CUDA,
// so that tests compile it for the host (tests/host_headers.py) and check the two readings against it.
#pragma once

namespace moe_ep {
namespace intranode {

// Host-mapped int32 record each rank's kernels report into (the host polls it; no device sync).
enum HostInfo : int {
    kHostDone = 0,          // notify: the nonce of the last finished count exchange
    kHostError = 1,         // 1 once a wait failed; the fields below say where
    kHostErrorKind = 2,     // ErrorKind
    kHostErrorPeer = 3,     // the rank that did not arrive
    kHostErrorWindow = 4,   // the window waited for
    kHostOverflow = 5,      // rows received when they exceeded num_recv_rows (num_worst_tokens), else 0
    kHostTotal = 6,         // notify: rows this rank receives
    kHostMaxTokens = 7,     // notify: largest num_tokens over the ranks
    kHostErrorCall = 8,     // the failed wait: the call number it waited for (low 31 bits)
    kHostErrorSeen = 9,     // ... and the call number the peer's flag last announced (-1: none yet)
    // The progress mark (ProgressMark) of this rank's last intranode kernel to start (its
    // block 0) and to finish (its last block): where the stream stands when a host wait runs out.
    kHostKernelStarted = 10,
    kHostKernelFinished = 11,
    // A failed wait's peer: its last intranode kernel to start (the same mark; 0: none yet, -1: the
    // failed kernel keeps no marks) and how long before the failure it started, in ms. A peer still in
    // an earlier call was held up before the kernel (its host, an event its stream waits for, or SMs),
    // one in this call inside it.
    kHostErrorPeerStarted = 12,
    kHostErrorPeerStartedMs = 13,
    kHostErrorPeerBlocks = 14,  // ... and how many blocks of its running kernel had started
    kHostErrorBlocks = 15,      // the failed wait's kernel: its blocks (gridDim.x)
    kHostChoice = 16,       // a one-pass kernel's choice of its call's path (PathChoice: 1 one pass, 0 two)
    kHostChoiceDone = 17,   // ... the nonce of that call, written after kHostChoice
    kHostCounts = 18,       // notify: [R] rows from each rank, [R] tokens to each rank, [E/R] per local expert
};
enum KernelId : int {
    kKernelNotify = 1, kKernelDispatch, kKernelCombine, kKernelStreamCombine, kKernelZeroCopyDispatch,
    kKernelZeroCopyCombine, kKernelRendezvous,
    kKernelIdEnd,  // one past the last id
};
// A progress mark (kHostKernelStarted, kHostKernelFinished, kHostErrorPeerStarted): KernelId << kMarkCallBits
// | the call number's low kMarkCallBits bits.
enum ProgressMark : int { kMarkCallBits = 24 };
enum ErrorKind : int {
    kErrNone = 0, kErrNotify, kErrStaged, kErrReleased, kErrOpen, kErrPushed,
    kErrLowLatencyDispatch,  // window = the global expert whose tokens did not come
    kErrLowLatencyCombine,
    kErrRingRoom,  // streaming combine (window = the channel): room in the peer's ring
    kErrRingRows,  // ... rows in this rank's ring
    kErrRendezvous,  // (window = the KernelId of the kernel the rendezvous opens) the peer's arrival
    // Internode calls: the peer's arrival at the call; (window = the chunk) a chunk of its dispatch
    // messages; its forwarded rows; its combine rows pushed to this forwarder; (window = the chunk) a
    // chunk of its node's sums.
    kErrInternodeArrive, kErrInternodeChunk, kErrInternodeForwarded, kErrInternodePushed, kErrInternodeSums,
    kErrorKindEnd,   // one past the last kind
};
// Wait profile (Ctx::wait_ns): per block, nanoseconds spent waiting by ErrorKind (kErrNotify ..
// kErrPushed), then in each phase of the kernels (their waits included), then the kernel's whole time
// in the last slot.
enum ProfilePhase : int { kPhaseStage = kErrPushed + 1, kPhasePull, kPhasePush, kPhaseReduce };
constexpr int kWaitSlots = kPhaseReduce + 2;

}  // namespace intranode

namespace low_latency {

// The columns of the timeline the low-latency kernels stamp in a measuring build (api.cuh, timeline_read).
enum TimelineColumn : int {
    kCallNumber,      // the call's number
    kCallKind,        // TimelineCallKind
    kSendFirstStart,  // first send block running
    kSendLastStart,   // last send block running
    kSendLastEnd,     // last send block done with its rows
    kFlagsRaised,     // the last block has raised every flag
    kWaitStart,       // the wait kernel running
    kWaitSeen,        // every flag seen
    kRecvFirstStart,  // first receive block running
    kRecvLastEnd,     // last receive block done
    kTimelineColumns
};
// What kCallKind holds.
enum TimelineCallKind : int { kTimelineDispatch = 1, kTimelineCombine = 2 };

}  // namespace low_latency

// Every enumerator above by the name Python knows it by, in value order: csrc/bindings.cpp exports each
// table of kReportTables as a dict (moe_ep._C.HOST_INFO, ...), which moe_ep.backends.peers.KernelEnums
// reads.
struct NamedValue {
    const char* name;
    int value;
};

constexpr NamedValue kHostInfoNames[] = {
    {"DONE", intranode::kHostDone},
    {"ERROR", intranode::kHostError},
    {"ERROR_KIND", intranode::kHostErrorKind},
    {"ERROR_PEER", intranode::kHostErrorPeer},
    {"ERROR_WINDOW", intranode::kHostErrorWindow},
    {"OVERFLOW", intranode::kHostOverflow},
    {"TOTAL", intranode::kHostTotal},
    {"MAX_TOKENS", intranode::kHostMaxTokens},
    {"ERROR_CALL", intranode::kHostErrorCall},
    {"ERROR_SEEN", intranode::kHostErrorSeen},
    {"KERNEL_STARTED", intranode::kHostKernelStarted},
    {"KERNEL_FINISHED", intranode::kHostKernelFinished},
    {"ERROR_PEER_STARTED", intranode::kHostErrorPeerStarted},
    {"ERROR_PEER_STARTED_MS", intranode::kHostErrorPeerStartedMs},
    {"ERROR_PEER_BLOCKS", intranode::kHostErrorPeerBlocks},
    {"ERROR_BLOCKS", intranode::kHostErrorBlocks},
    {"CHOICE", intranode::kHostChoice},
    {"CHOICE_DONE", intranode::kHostChoiceDone},
    {"COUNTS", intranode::kHostCounts},
};
constexpr NamedValue kKernelIdNames[] = {
    {"NOTIFY", intranode::kKernelNotify},
    {"DISPATCH", intranode::kKernelDispatch},
    {"COMBINE", intranode::kKernelCombine},
    {"STREAM_COMBINE", intranode::kKernelStreamCombine},
    {"ZERO_COPY_DISPATCH", intranode::kKernelZeroCopyDispatch},
    {"ZERO_COPY_COMBINE", intranode::kKernelZeroCopyCombine},
    {"RENDEZVOUS", intranode::kKernelRendezvous},
};
constexpr NamedValue kProgressMarkNames[] = {
    {"CALL_BITS", intranode::kMarkCallBits},
};
constexpr NamedValue kErrorKindNames[] = {
    {"NONE", intranode::kErrNone},
    {"NOTIFY", intranode::kErrNotify},
    {"STAGED", intranode::kErrStaged},
    {"RELEASED", intranode::kErrReleased},
    {"OPEN", intranode::kErrOpen},
    {"PUSHED", intranode::kErrPushed},
    {"LOW_LATENCY_DISPATCH", intranode::kErrLowLatencyDispatch},
    {"LOW_LATENCY_COMBINE", intranode::kErrLowLatencyCombine},
    {"RING_ROOM", intranode::kErrRingRoom},
    {"RING_ROWS", intranode::kErrRingRows},
    {"RENDEZVOUS", intranode::kErrRendezvous},
    {"INTERNODE_ARRIVE", intranode::kErrInternodeArrive},
    {"INTERNODE_CHUNK", intranode::kErrInternodeChunk},
    {"INTERNODE_FORWARDED", intranode::kErrInternodeForwarded},
    {"INTERNODE_PUSHED", intranode::kErrInternodePushed},
    {"INTERNODE_SUMS", intranode::kErrInternodeSums},
};
constexpr NamedValue kProfilePhaseNames[] = {
    {"STAGE", intranode::kPhaseStage},
    {"PULL", intranode::kPhasePull},
    {"PUSH", intranode::kPhasePush},
    {"REDUCE", intranode::kPhaseReduce},
};
constexpr NamedValue kTimelineColumnNames[] = {
    {"CALL_NUMBER", low_latency::kCallNumber},
    {"CALL_KIND", low_latency::kCallKind},
    {"SEND_FIRST_START", low_latency::kSendFirstStart},
    {"SEND_LAST_START", low_latency::kSendLastStart},
    {"SEND_LAST_END", low_latency::kSendLastEnd},
    {"FLAGS_RAISED", low_latency::kFlagsRaised},
    {"WAIT_START", low_latency::kWaitStart},
    {"WAIT_SEEN", low_latency::kWaitSeen},
    {"RECV_FIRST_START", low_latency::kRecvFirstStart},
    {"RECV_LAST_END", low_latency::kRecvLastEnd},
};
constexpr NamedValue kTimelineCallKindNames[] = {
    {"DISPATCH", low_latency::kTimelineDispatch},
    {"COMBINE", low_latency::kTimelineCombine},
};

// A name table under the name the extension exports it by.
struct NamedTable {
    const char* name;
    const NamedValue* values;
    int size;
};
template <int N>
constexpr NamedTable named_table(const char* name, const NamedValue (&values)[N]) {
    return {name, values, N};
}
// The tables the extension exports, each as moe_ep._C.<name> (moe_ep/backends/reports.py reads this list).
constexpr NamedTable kReportTables[] = {
    named_table("HOST_INFO", kHostInfoNames),
    named_table("KERNEL_IDS", kKernelIdNames),
    named_table("PROGRESS_MARK", kProgressMarkNames),
    named_table("ERROR_KINDS", kErrorKindNames),
    named_table("PROFILE_PHASES", kProfilePhaseNames),
    named_table("TIMELINE_COLUMNS", kTimelineColumnNames),
    named_table("TIMELINE_CALL_KINDS", kTimelineCallKindNames),
};

// Whether `names` holds the values first..last, each once and in order: an enumerator added without its
// name, or named out of place, fails the asserts below.
template <int N>
constexpr bool names_every(const NamedValue (&names)[N], int first, int last) {
    if (N != last - first + 1) return false;
    for (int i = 0; i < N; ++i)
        if (names[i].value != first + i) return false;
    return true;
}
static_assert(names_every(kHostInfoNames, intranode::kHostDone, intranode::kHostCounts),
              "a HostInfo slot without its name");
static_assert(names_every(kKernelIdNames, intranode::kKernelNotify, intranode::kKernelIdEnd - 1),
              "a KernelId without its name");
static_assert(names_every(kProgressMarkNames, intranode::kMarkCallBits, intranode::kMarkCallBits),
              "a ProgressMark field without its name");
static_assert(names_every(kErrorKindNames, intranode::kErrNone, intranode::kErrorKindEnd - 1),
              "an ErrorKind without its name");
static_assert(names_every(kProfilePhaseNames, intranode::kPhaseStage, intranode::kWaitSlots - 2),
              "a ProfilePhase without its name");
static_assert(names_every(kTimelineColumnNames, 0, low_latency::kTimelineColumns - 1),
              "a TimelineColumn without its name");
static_assert(names_every(kTimelineCallKindNames, low_latency::kTimelineDispatch, low_latency::kTimelineCombine),
              "a TimelineCallKind without its name");

}  // namespace moe_ep
