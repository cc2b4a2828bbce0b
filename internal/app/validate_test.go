package app_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/store"
)

// Flags that contradict each other fail before anything connects, with a
// message naming the flags.
func TestValidateNamesTheFlag(t *testing.T) {
	file := filepath.Join(t.TempDir(), "seed.nk")
	if err := os.WriteFile(file, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	valid := func() app.Options {
		return app.Options{
			NATSURL: "nats://127.0.0.1:4222", Table: store.Table{Schema: "public", Name: "outbox"}, Stream: "OUTBOX",
			Slot: "outbox_relay", Publication: "outbox_relay",
			SubjectPrefix: "outbox.", Policy: store.PolicyMark, DuplicateWindow: 2 * time.Minute, AckTimeout: 10 * time.Second,
			MaxInFlight: 10, MaxInFlightBytes: 1 << 20,
		}
	}
	if o := valid(); o.Validate() != nil {
		t.Fatalf("the valid options fail: %v", o.Validate())
	}
	cases := []struct {
		name   string
		change func(*app.Options)
		want   []string
	}{
		{"no nats url", func(o *app.Options) { o.NATSURL = "" }, []string{"--nats-url"}},
		{"pooled without a direct slot", func(o *app.Options) { o.Pooler = app.PoolerTransaction }, []string{"--database-pooler transaction", "--replication-database-url"}},
		{"unknown pooler", func(o *app.Options) { o.Pooler = "statement" }, []string{"--database-pooler", `"statement"`, "transaction"}},
		{"two password sources", func(o *app.Options) { o.DBPassword = app.DBPassword{IAM: app.IAMAWS, Command: "true"} }, []string{"--database-iam", "--database-password-command", "give one"}},
		{"iam region without iam", func(o *app.Options) { o.DBPassword = app.DBPassword{IAMRegion: "eu-west-1"} }, []string{"--database-iam-region", "--database-iam aws"}},
		{"stream with dot", func(o *app.Options) { o.Stream = "A.B" }, []string{"--stream", "A.B"}},
		{"empty stream", func(o *app.Options) { o.Stream = "" }, []string{"--stream", "empty"}},
		{"stream with slash", func(o *app.Options) { o.Stream = "a/b" }, []string{"--stream", `"a/b"`, "path separator '/'"}},
		{"stream with backslash", func(o *app.Options) { o.Stream = `a\b` }, []string{"--stream", `path separator '\\'`}},
		{"stream with star", func(o *app.Options) { o.Stream = "A*" }, []string{"--stream", "'*'"}},
		{"stream with gt", func(o *app.Options) { o.Stream = "A>" }, []string{"--stream", "'>'"}},
		{"stream with space", func(o *app.Options) { o.Stream = "A B" }, []string{"--stream", "whitespace"}},
		{"stream with tab", func(o *app.Options) { o.Stream = "A\tB" }, []string{"--stream", "whitespace"}},
		{"stream with newline", func(o *app.Options) { o.Stream = "A\nB" }, []string{"--stream", `"A\nB"`, "whitespace"}},
		{"stream with no-break space", func(o *app.Options) { o.Stream = "A\u00a0B" }, []string{"--stream", "whitespace"}},
		{"stream with escape", func(o *app.Options) { o.Stream = "A\x1b[2K" }, []string{"--stream", `\x1b`, "non-printing"}},
		{"stream with bidi control", func(o *app.Options) { o.Stream = "A\u202eB" }, []string{"--stream", "U+202E"}},
		{"stream not UTF-8", func(o *app.Options) { o.Stream = "A\xffB" }, []string{"--stream", "UTF-8"}},
		{"stream too long", func(o *app.Options) { o.Stream = strings.Repeat("S", 256) }, []string{"--stream", "256 bytes", "1 to 255 bytes"}},
		{"allowed stream with slash", func(o *app.Options) { o.AllowStreams = []string{"OK", "a/b"} }, []string{"--allow-stream", `"a/b"`, "path separator"}},
		{"unknown ordering", func(o *app.Options) { o.Ordering = "maybe" }, []string{"--ordering", `"maybe"`, "aggregate"}},
		{"atomic with ordering", func(o *app.Options) { o.AtomicTransactions, o.Ordering = true, app.OrderingAggregate }, []string{"--atomic-transactions", "--ordering aggregate"}},
		{"atomic batch of one", func(o *app.Options) { o.AtomicTransactions, o.AtomicBatchMax = true, 1 }, []string{"--atomic-batch-max", "max_batch_size"}},
		{"negative deadline margin", func(o *app.Options) { o.DeadlineMargin = -time.Second }, []string{"--deadline-margin", "negative"}},
		{"bad standby slot", func(o *app.Options) { o.StandbySlots = []string{"Standby-A"} }, []string{"--standby-slot", "Standby-A"}},
		{"prefix $JS", func(o *app.Options) { o.SubjectPrefix = "$JS." }, []string{"--subject-prefix", "reserved", "$JS"}},
		{"prefix $SYS", func(o *app.Options) { o.SubjectPrefix = "$SYS.outbox." }, []string{"--subject-prefix", "reserved"}},
		{"prefix $KV", func(o *app.Options) { o.SubjectPrefix = "$KV.x." }, []string{"--subject-prefix", "reserved"}},
		{"prefix _INBOX", func(o *app.Options) { o.SubjectPrefix = "_INBOX." }, []string{"--subject-prefix", "_INBOX", "reply"}},
		{"prefix under _INBOX", func(o *app.Options) { o.SubjectPrefix = "_INBOX.outbox." }, []string{"--subject-prefix", "_INBOX"}},
		{"slot with capitals", func(o *app.Options) { o.Slot = "Outbox-Slot" }, []string{"--slot", "Outbox-Slot", "lower-case letters"}},
		{"empty slot", func(o *app.Options) { o.Slot = "" }, []string{"--slot", "lower-case letters"}},
		{"slot too long", func(o *app.Options) { o.Slot = strings.Repeat("s", 64) }, []string{"--slot", "1 to 63"}},
		{"publication with dash", func(o *app.Options) { o.Publication = "out-box" }, []string{"--publication", "out-box", "lower-case letters"}},
		{"prefix without dot", func(o *app.Options) { o.SubjectPrefix = "outbox" }, []string{"--subject-prefix"}},
		{"prefix wildcard", func(o *app.Options) { o.SubjectPrefix = "out.*." }, []string{"--subject-prefix"}},
		{"cert without key", func(o *app.Options) { o.NATS.CertFile = file }, []string{"--nats-tls-cert", "--nats-tls-key"}},
		{"token and user", func(o *app.Options) { o.NATS.Token, o.NATS.User = "t", "u" }, []string{"--nats-token", "--nats-user"}},
		{"password alone", func(o *app.Options) { o.NATS.Password = "p" }, []string{"--nats-password", "--nats-user"}},
		{"user and creds", func(o *app.Options) { o.NATS.User, o.NATS.CredsFile = "u", file }, []string{"--nats-user", "--nats-creds"}},
		{"creds and nkey", func(o *app.Options) { o.NATS.CredsFile, o.NATS.NKeyFile = file, file }, []string{"--nats-creds", "--nats-nkey"}},
		{"missing creds file", func(o *app.Options) { o.NATS.CredsFile = "/nonexistent/x.creds" }, []string{"--nats-creds", "/nonexistent/x.creds"}},
		{"missing CA", func(o *app.Options) { o.NATS.CAFile = "/nonexistent/ca.pem" }, []string{"--nats-tls-ca"}},
		{"zero ack timeout", func(o *app.Options) { o.AckTimeout = 0 }, []string{"--ack-timeout"}},
		{"lease under ack timeout", func(o *app.Options) { o.Lease = 5 * time.Second }, []string{"--lease", "--ack-timeout"}},
		{"short duplicate window", func(o *app.Options) { o.DuplicateWindow = time.Millisecond }, []string{"--duplicate-window"}},
		{"no in-flight room", func(o *app.Options) { o.MaxInFlight = 0 }, []string{"--max-in-flight"}},
		{"backoff min above max", func(o *app.Options) { o.BackoffMin, o.BackoffMax = time.Minute, time.Second }, []string{"--backoff-min", "--backoff-max"}},
		{"negative stats interval", func(o *app.Options) { o.StatsInterval = -time.Second }, []string{"--stats-interval"}},
	}
	// What the server and PostgreSQL accept must still pass.
	for _, ok := range []func(*app.Options){
		func(o *app.Options) { o.Stream = "T_orders-v2_1" },
		func(o *app.Options) { o.Stream = "Bestellungen_ä" },
		func(o *app.Options) { o.Stream = strings.Repeat("S", 255) },
		func(o *app.Options) { o.SubjectPrefix = "INBOX.outbox." },
		func(o *app.Options) { o.SubjectPrefix = "app._INBOX." },
		func(o *app.Options) { o.SubjectPrefix = "_INBOXES." },
		func(o *app.Options) { o.SubjectPrefix = "a$b." },
		func(o *app.Options) { o.Slot = strings.Repeat("s", 63) },
	} {
		o := valid()
		ok(&o)
		if err := o.Validate(); err != nil {
			t.Errorf("Validate refused valid options: %v", err)
		}
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			o := valid()
			c.change(&o)
			err := o.Validate()
			if err == nil {
				t.Fatal("Validate accepted it")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%q does not name %q", err, w)
				}
			}
		})
	}
}
