package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Against a broker that requires a login (a user and password, or TLS with
// a client certificate), every command that talks to NATS logs in from the
// same OUTBOX_RELAY_* variables a deployment sets once: run publishes,
// status reads the stream, redrive looks an uncertain row up, republish
// --dry-run checks the stream, and the demo runs end to end. No output or
// log holds the password. (Before the NATS flags were common, status,
// redrive's lookup and republish connected with the URL alone.)
func TestEveryCommandLogsInToAnAuthenticatedBroker(t *testing.T) {
	const password = "Pw-kq93-Zr7x-Secret"
	for _, mode := range []string{"user-password", "tls-client-cert"} {
		t.Run(mode, func(t *testing.T) {
			vars := map[string]string{}
			var conf string
			var login []nats.Option
			switch mode {
			case "user-password":
				conf = fmt.Sprintf("authorization {\n  users = [ {user: relay, password: %q} ]\n}", password)
				login = []nats.Option{nats.UserInfo("relay", password)}
				vars["nats-user"], vars["nats-password"] = "relay", password
			case "tls-client-cert":
				ca, cert, key := writeTLSFiles(t, t.TempDir())
				conf = fmt.Sprintf("tls {\n  cert_file: %q\n  key_file: %q\n  ca_file: %q\n  verify: true\n}", cert.server, key.server, ca)
				login = []nats.Option{nats.RootCAs(ca), nats.ClientCert(cert.client, key.client)}
				vars["nats-tls-ca"], vars["nats-tls-cert"], vars["nats-tls-key"] = ca, cert.client, key.client
			}
			srv, err := testenv.StartNATS(testenv.NATSOptions{Conf: conf, ReadyUser: "relay", ReadyPassword: password, ReadyOptions: login})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(srv.Close)
			// The broker must refuse a client without the login, or the
			// test would pass with commands that ignore it.
			if nc, err := nats.Connect(srv.URL(), nats.Timeout(5*time.Second), nats.NoReconnect()); err == nil {
				nc.Close()
				t.Fatal("the broker accepted a client without a login")
			}

			env := testenv.Shared(t)
			stream, prefix := env.StreamName(t)
			url := env.PG.CreateDatabase(t)
			vars["database-url"], vars["nats-url"], vars["stream"], vars["subject-prefix"] = url, srv.URL(), stream, prefix
			vars["slot"] = "auth_" + strings.ReplaceAll(mode, "-", "_")
			for name, v := range vars {
				t.Setenv(config.EnvName(name), v)
			}
			var said strings.Builder
			cmd := func(args ...string) (int, string) {
				t.Helper()
				code, out, errOut := run(t, args...)
				said.WriteString(out + errOut)
				return code, out + errOut
			}
			if code, _ := cmd("migrate"); code != 0 {
				t.Fatalf("migrate exited %d", code)
			}
			pool, err := pgxpool.New(context.Background(), url)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)

			admin, err := nats.Connect(srv.URL(), append(login, nats.Timeout(5*time.Second))...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(admin.Close)
			js, err := jetstream.New(admin)
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()

			// run publishes.
			said.WriteString(runOne(t, []string{"run"}, func() {
				mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload) VALUES ('w-run', 'k', '{}')`)
				testenv.WaitFor(t, 30*time.Second, "run to publish w-run", func() (bool, error) {
					state, _, _ := stateOf(t, pool, "w-run")
					return state == "published", nil
				})
			}))
			st, err := js.Stream(ctx, stream)
			if err != nil {
				t.Fatal(err)
			}
			m, err := st.GetLastMsgForSubject(ctx, prefix+"k")
			if err != nil || m.Header.Get(jetstream.MsgIDHeader) != "w-run" {
				t.Fatalf("last message on %sk: %v, %v; want w-run", prefix, m, err)
			}

			// status reads the stream.
			code, out := cmd("status", "--json")
			var rep statusReport
			if err := json.Unmarshal([]byte(out[:strings.LastIndex(out, "}")+1]), &rep); code != 0 || err != nil {
				t.Fatalf("status --json exited %d: %v", code, err)
			}
			if rep.Stream == nil || rep.Stream.Error != "" || rep.Stream.Messages != 1 {
				t.Fatalf("status reports the stream as %+v; want it read, with 1 message", rep.Stream)
			}

			// redrive looks an uncertain row up and finds it stored.
			msg := nats.NewMsg(prefix + "k")
			msg.Header.Set(jetstream.MsgIDHeader, "u-in")
			msg.Data = []byte(`{}`)
			if _, err := js.PublishMsg(ctx, msg); err != nil {
				t.Fatal(err)
			}
			mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, available_at)
				VALUES ('u-in', 'k', '{}', 'failed', 10, 'uncertain: no ack in time', clock_timestamp() - interval '1 second')`)
			code, out = cmd("redrive", "--reason", "r", "--work-id", "u-in", "--stagger", "0s")
			if code != 0 || !strings.Contains(out, "found u-in: stream "+stream) {
				t.Fatalf("redrive exited %d without finding u-in in the stream:\n%s", code, out)
			}
			if state, _, _ := stateOf(t, pool, "u-in"); state != "published" {
				t.Fatalf("u-in is %s after redrive found it, want published", state)
			}

			// republish --dry-run checks a published row the stream lacks.
			mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at) VALUES ('w-rep', 'k', '{}', 'published', clock_timestamp())`)
			code, out = cmd("republish", "--since", "1h", "--dry-run")
			if code != 0 || !strings.Contains(out, "would republish 1 rows: w-rep") {
				t.Fatalf("republish --dry-run exited %d:\n%s", code, out)
			}

			// the demo, on the same variables.
			code, out = runLogging(t, "demo")
			said.WriteString(out)
			if code != 0 || !strings.Contains(out, "5 rows committed, 5 in the stream (0 duplicates)") {
				t.Fatalf("demo exited %d; stdout lacks the summary", code)
			}
			noSecret(t, mode, said.String(), password)
		})
	}
}

type tlsPair struct{ server, client string }

// writeTLSFiles writes a CA, a server certificate for 127.0.0.1 and a
// client certificate, both signed by the CA, and their keys, in PEM.
func writeTLSFiles(t *testing.T, dir string) (ca string, cert, key tlsPair) {
	t.Helper()
	newKey := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	writeKey := func(name string, k *ecdsa.PrivateKey) string {
		der, err := x509.MarshalECPrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		return write(name, "EC PRIVATE KEY", der)
	}
	now := time.Now()
	caKey := newKey()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "outbox-relay test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	ca = write("ca.pem", "CERTIFICATE", caDER)
	leaf := func(serial int64, cn string, usage x509.ExtKeyUsage) (string, string) {
		k := newKey()
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn},
			NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
		if usage == x509.ExtKeyUsageServerAuth {
			tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &k.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		return write(cn+".pem", "CERTIFICATE", der), writeKey(cn+"-key.pem", k)
	}
	cert.server, key.server = leaf(2, "server", x509.ExtKeyUsageServerAuth)
	cert.client, key.client = leaf(3, "client", x509.ExtKeyUsageClientAuth)
	return ca, cert, key
}
