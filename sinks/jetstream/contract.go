package jetstream

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// The broker contract (G21): what the guarantees need of the stream and the
// server, checked before a session publishes. A guarantee the stream cannot
// give is said at start (and again when it changes), at the level its
// consequence deserves: refuse where nothing could be delivered, warn where
// the stream weakens a guarantee. docs/deploy.md, "The broker contract",
// lists every check with its fix; Checks is that list.

// Levels of a finding.
const (
	LevelWarn   = "warn"
	LevelRefuse = "refuse"
)

// Checks of the broker contract, stable names for logs and the
// outbox_relay_broker_contract metric.
const (
	CheckNoAck           = "no_ack"
	CheckSealed          = "sealed"
	CheckMemoryStorage   = "memory_storage"
	CheckUnsyncedStore   = "unsynced_store"
	CheckDuplicateWindow = "duplicate_window"
	CheckMaxMsgSize      = "max_msg_size"
	CheckDiscardNew      = "discard_new"
	CheckRetention       = "retention"
	CheckMsgTTL          = "msg_ttl"
	CheckServerVersion   = "server_version"
	CheckAtomicPublish   = "atomic_publish"
)

// Checks is every check, in the order they are reported.
var Checks = []string{CheckNoAck, CheckSealed, CheckMemoryStorage, CheckUnsyncedStore, CheckDuplicateWindow,
	CheckMaxMsgSize, CheckDiscardNew, CheckRetention, CheckMsgTTL, CheckServerVersion, CheckAtomicPublish}

// Finding is one way the stream or server falls short of the contract.
type Finding struct {
	Check string
	Level string
	// Msg says what falls short and what it costs; Fix what to do.
	Msg, Fix string
}

func (f Finding) String() string { return f.Msg + ": " + f.Fix }

// Contract is what the relay's settings ask of the stream.
type Contract struct {
	// RetrySpan is the longest time the relay may take, on its own, to
	// publish a row again after an attempt whose outcome it did not learn
	// (the poller's longest backoff, a lease that must expire before a
	// claim is taken again), and RetrySpanFrom names the flag it comes from.
	RetrySpan     time.Duration
	RetrySpanFrom string
	// DeadlineTTL: rows with a deadline are to carry Nats-TTL (G21).
	DeadlineTTL bool
	// AtomicBatches: transactions are to be published as atomic batches
	// (G20, run --atomic-transactions).
	AtomicBatches bool
}

// ServerSync is the server's JetStream sync setting, when it could be read
// (its monitoring endpoint, run --nats-monitor-url); nil when unknown.
type ServerSync struct {
	Always   bool
	Interval time.Duration
}

// Versions of nats-server that brought the features the contract uses.
var (
	versionMsgTTL = [3]int{2, 11, 0}
	versionAtomic = [3]int{2, 12, 0}
)

// CheckContract compares the stream (its info as the server reports it),
// the server's version and sync setting (nil: unknown) with what c needs.
func CheckContract(info *jetstream.StreamInfo, serverVersion string, sync *ServerSync, c Contract) []Finding {
	cfg := info.Config
	name := cfg.Name
	var out []Finding
	add := func(check, level, msg, fix string) {
		out = append(out, Finding{Check: check, Level: level, Msg: msg, Fix: fix})
	}
	if cfg.NoAck {
		add(CheckNoAck, LevelRefuse,
			fmt.Sprintf("stream %s has no_ack set: the broker never acknowledges a publish, so no row could be confirmed (every publish would time out as uncertain)", name),
			fmt.Sprintf("turn acknowledgements on (nats stream edit %s --ack), or publish to another stream", name))
	}
	if cfg.Sealed {
		add(CheckSealed, LevelRefuse,
			fmt.Sprintf("stream %s is sealed: it refuses every new message", name),
			"publish to another stream (--stream); a sealed stream cannot be unsealed")
	}
	if cfg.Storage == jetstream.MemoryStorage {
		add(CheckMemoryStorage, LevelWarn,
			fmt.Sprintf("stream %s keeps its messages in memory: a broker restart loses every message it had acknowledged", name),
			"use file storage (a new stream: storage cannot be changed), with 3 replicas")
	}
	if cfg.Storage == jetstream.FileStorage && cfg.Replicas <= 1 && (sync == nil || !sync.Always) {
		how := "nats-server's sync setting could not be read (give --nats-monitor-url to let the relay read it)"
		if sync != nil {
			interval := sync.Interval
			if interval <= 0 {
				interval = 2 * time.Minute
			}
			how = fmt.Sprintf("nats-server syncs to disk every %s", interval)
		}
		add(CheckUnsyncedStore, LevelWarn,
			fmt.Sprintf("stream %s is file storage with one replica and %s: messages it acknowledged since the last sync are lost on an OS crash or power loss, after the relay confirmed them", name, how),
			fmt.Sprintf("use 3 replicas (nats stream edit %s --replicas 3, on a cluster), or run nats-server with jetstream { sync_interval: always } (every write fsynced, slower)", name))
	}
	if c.RetrySpan > 0 && cfg.Duplicates < c.RetrySpan {
		add(CheckDuplicateWindow, LevelWarn,
			fmt.Sprintf("stream %s's duplicate window %s is shorter than %s: a row published again after an attempt whose ack was lost can be stored twice once the window has passed", name, cfg.Duplicates, c.RetrySpanFrom),
			fmt.Sprintf("raise the window to at least %s (nats stream edit %s --dupe-window %s), or lower %s", c.RetrySpan, name, c.RetrySpan, strings.SplitN(c.RetrySpanFrom, " ", 2)[0]))
	}
	if cfg.MaxMsgSize > 0 {
		add(CheckMaxMsgSize, LevelWarn,
			fmt.Sprintf("stream %s refuses messages over %d bytes (max_msg_size): a row larger than that is rejected and ends a dead letter (G7)", name, cfg.MaxMsgSize),
			fmt.Sprintf("raise or remove the limit (nats stream edit %s --max-msg-size -1) if rows can be that large", name))
	}
	if cfg.Discard == jetstream.DiscardNew && (cfg.MaxMsgs > 0 || cfg.MaxBytes > 0 || cfg.MaxMsgsPerSubject > 0) {
		add(CheckDiscardNew, LevelWarn,
			fmt.Sprintf("stream %s discards new messages when full (max_msgs %d, max_bytes %d, max_msgs_per_subject %d): once it is full every publish is refused, and rows wait with the poller until it has room", name, cfg.MaxMsgs, cfg.MaxBytes, cfg.MaxMsgsPerSubject),
			fmt.Sprintf("use discard old (nats stream edit %s --discard old), or raise the limits", name))
	}
	if cfg.Retention != jetstream.LimitsPolicy {
		add(CheckRetention, LevelWarn,
			fmt.Sprintf("stream %s uses %s retention: a message leaves the stream once consumed, so the relay cannot tell a consumed message from one the broker lost", name, cfg.Retention),
			"use limits retention for the outbox stream and let consumers track their own progress")
	}
	version, knownVersion := parseVersion(serverVersion)
	if c.DeadlineTTL && !cfg.AllowMsgTTL {
		// The advice is what this server can do: before 2.11 the stream
		// has no such setting to edit.
		fix := fmt.Sprintf("allow it (nats stream edit %s --allow-msg-ttl; it cannot be turned off again), or run with --deadline-ttl=false to silence this", name)
		if knownVersion && less(version, versionMsgTTL) {
			fix = fmt.Sprintf("upgrade nats-server (%s has no per-message TTL; 2.11 or newer does), then allow it (nats stream edit %s --allow-msg-ttl); or run with --deadline-ttl=false to silence this", serverVersion, name)
		}
		add(CheckMsgTTL, LevelWarn,
			fmt.Sprintf("stream %s does not allow per-message TTL: rows with a deadline are published without Nats-TTL, so only receivers enforce the deadline (Outbox-Expires-At)", name), fix)
	}
	if c.AtomicBatches && !cfg.AllowAtomicPublish {
		add(CheckAtomicPublish, LevelRefuse,
			fmt.Sprintf("stream %s does not allow atomic batch publish, which --atomic-transactions needs to store each transaction whole (G20)", name),
			fmt.Sprintf("allow it (nats stream edit %s --allow-batch, or \"allow_atomic\": true in its configuration; the relay never changes an existing stream), or run without --atomic-transactions", name))
	}
	if v, ok := version, knownVersion; ok {
		if c.AtomicBatches && less(v, versionAtomic) {
			add(CheckServerVersion, LevelRefuse,
				fmt.Sprintf("nats-server %s cannot store a batch atomically (2.12 or newer can), which --atomic-transactions needs", serverVersion),
				"upgrade nats-server to 2.12 or newer, or run without --atomic-transactions")
		}
		if c.DeadlineTTL && cfg.AllowMsgTTL && less(v, versionMsgTTL) {
			add(CheckServerVersion, LevelWarn,
				fmt.Sprintf("nats-server %s does not know per-message TTL (2.11 or newer does): deadlines are enforced by receivers only", serverVersion),
				"upgrade nats-server to 2.11 or newer")
		}
	}
	return out
}

// parseVersion reads "2.11.4" (or "v2.11.4-beta"): major, minor, patch.
func parseVersion(s string) ([3]int, bool) {
	var v [3]int
	s = strings.TrimPrefix(s, "v")
	if i := strings.IndexAny(s, "-+ "); i >= 0 {
		s = s[:i]
	}
	parts := strings.Split(s, ".")
	if len(parts) < 2 {
		return v, false
	}
	for i := 0; i < len(parts) && i < 3; i++ {
		n, err := strconv.Atoi(parts[i])
		if err != nil {
			return v, false
		}
		v[i] = n
	}
	return v, true
}

func less(a, b [3]int) bool {
	for i := range a {
		if a[i] != b[i] {
			return a[i] < b[i]
		}
	}
	return false
}

// ReadServerSync reads nats-server's JetStream sync setting from its
// monitoring endpoint (/varz on the -m port): a client connection cannot
// ask for it.
//
// Every error names the endpoint without its password: the relay logs them.
func ReadServerSync(ctx context.Context, monitorURL string) (*ServerSync, error) {
	u := strings.TrimRight(monitorURL, "/") + "/varz"
	shown := u
	if pu, err := url.Parse(u); err == nil {
		shown = pu.Redacted()
	} else {
		shown = "--nats-monitor-url (unparsable, not shown)"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, fmt.Errorf("read nats-server's sync setting from %s: %s", shown, strings.ReplaceAll(err.Error(), u, shown))
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			// Its text quotes the URL as given.
			err = ue.Err
		}
		return nil, fmt.Errorf("read nats-server's sync setting from %s: %w", shown, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("read nats-server's sync setting from %s: %s", shown, resp.Status)
	}
	var varz struct {
		JetStream struct {
			Config struct {
				SyncInterval time.Duration `json:"sync_interval"`
				SyncAlways   bool          `json:"sync_always"`
			} `json:"config"`
		} `json:"jetstream"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 4<<20)).Decode(&varz); err != nil {
		return nil, fmt.Errorf("read nats-server's sync setting from %s: %w", shown, err)
	}
	return &ServerSync{Always: varz.JetStream.Config.SyncAlways, Interval: varz.JetStream.Config.SyncInterval}, nil
}
