package app_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/replication"
)

func TestDBPassword(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	file := filepath.Join(dir, "pw")
	if err := os.WriteFile(file, []byte("s3cret-one\r\nsecond line\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if pw, err := (app.DBPassword{File: file}).Get(ctx); err != nil || pw != "s3cret-one" {
		t.Errorf("file: %q, %v; want the first line without its end", pw, err)
	}
	if err := os.WriteFile(file, []byte("s3cret-two\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if pw, _ := (app.DBPassword{File: file}).Get(ctx); pw != "s3cret-two" {
		t.Errorf("file rewritten: %q, want it read again", pw)
	}
	if pw, err := (app.DBPassword{Command: "echo tok-123; echo more"}).Get(ctx); err != nil || pw != "tok-123" {
		t.Errorf("command: %q, %v", pw, err)
	}
	for _, c := range []struct {
		p    app.DBPassword
		want string
	}{
		{app.DBPassword{File: file, Command: "true"}, "give one of them"},
		{app.DBPassword{File: filepath.Join(dir, "none")}, "read --database-password-file"},
		{app.DBPassword{File: os.DevNull}, "is empty"},
	} {
		if err := c.p.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want %q", c.p, err, c.want)
		}
	}
	if _, err := (app.DBPassword{Command: "echo no credentials found >&2; exit 3"}).Get(ctx); err == nil ||
		!strings.Contains(err.Error(), "exit status 3: no credentials found") {
		t.Errorf("failing command: %v, want its status and its error output", err)
	}
	if _, err := (app.DBPassword{Command: "true"}).Get(ctx); err == nil || !strings.Contains(err.Error(), "printed nothing") {
		t.Errorf("silent command: %v", err)
	}
}

// --database-iam aws: each connection's password is a token signed for its
// own endpoint and user, with the AWS chain's credentials (here the
// environment's) in the region given, and reused while it is fresh
// (internal/rdsiam has the known answer and the refresh).
func TestDBPasswordIAM(t *testing.T) {
	t.Setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
	t.Setenv("AWS_SESSION_TOKEN", "")
	t.Setenv("AWS_CONFIG_FILE", os.DevNull)
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	ctx := context.Background()
	p := app.DBPassword{IAM: "aws", IAMRegion: "eu-west-1"}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	tok, err := p.For(ctx, "db.example.eu-west-1.rds.amazonaws.com", 5433, "relay")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"db.example.eu-west-1.rds.amazonaws.com:5433/?Action=connect", "DBUser=relay", "%2Feu-west-1%2Frds-db%2Faws4_request", "X-Amz-Expires=900", "X-Amz-Signature="} {
		if !strings.Contains(tok, want) {
			t.Errorf("token %q lacks %q", tok, want)
		}
	}
	if strings.Contains(tok, "wJalrXUtnFEMI") {
		t.Error("the token holds the secret key")
	}
	if again, _ := p.For(ctx, "db.example.eu-west-1.rds.amazonaws.com", 5433, "relay"); again != tok {
		t.Error("a second connection within the token's life got a new token")
	}
	if other, _ := p.For(ctx, "db.example.eu-west-1.rds.amazonaws.com", 5433, "observer"); other == tok || !strings.Contains(other, "DBUser=observer") {
		t.Errorf("another user got %q", other)
	}
	for _, c := range []struct {
		p    app.DBPassword
		want string
	}{
		{app.DBPassword{IAM: "aws", Command: "true"}, "give one of them"},
		{app.DBPassword{IAM: "gcp"}, "want aws"},
		{app.DBPassword{IAMRegion: "eu-west-1"}, "is for --database-iam aws"},
	} {
		if err := c.p.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want %q", c.p, err, c.want)
		}
	}
}

// Every kind of connection sends --database-iam aws's token, signed for its
// own endpoint and user: the pool's (run, the operator commands), the one
// connection (migrate) and the replication session. A server on loopback
// asks for the password in clear and records it.
func TestDBPasswordIAMReachesTheServer(t *testing.T) {
	t.Setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
	t.Setenv("AWS_SESSION_TOKEN", "")
	t.Setenv("AWS_CONFIG_FILE", os.DevNull)
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	passwords := make(chan string, 16)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				be := pgproto3.NewBackend(c, c)
				msg, err := be.ReceiveStartupMessage()
				if _, ok := msg.(*pgproto3.SSLRequest); ok && err == nil {
					if _, err := c.Write([]byte("N")); err != nil {
						return
					}
					msg, err = be.ReceiveStartupMessage()
				}
				if _, ok := msg.(*pgproto3.StartupMessage); !ok || err != nil {
					return
				}
				be.Send(&pgproto3.AuthenticationCleartextPassword{})
				if err := be.Flush(); err != nil {
					return
				}
				if err := be.SetAuthType(pgproto3.AuthTypeCleartextPassword); err != nil {
					return
				}
				m, err := be.Receive()
				if pw, ok := m.(*pgproto3.PasswordMessage); ok && err == nil {
					passwords <- pw.Password
				}
				be.Send(&pgproto3.ErrorResponse{Severity: "FATAL", Code: "28P01", Message: "password authentication failed"})
				_ = be.Flush()
			}()
		}
	}()
	port := l.Addr().(*net.TCPAddr).Port
	db := app.DB{URL: fmt.Sprintf("postgres://relay@127.0.0.1:%d/app?sslmode=disable&connect_timeout=5", port),
		Password: app.DBPassword{IAM: "aws", IAMRegion: "eu-west-1"}}
	want := fmt.Sprintf("127.0.0.1:%d/?Action=connect&DBUser=relay&", port)
	got := func(what string) {
		t.Helper()
		select {
		case pw := <-passwords:
			if !strings.HasPrefix(pw, want) || !strings.Contains(pw, "%2Feu-west-1%2Frds-db%2F") {
				t.Errorf("%s sent %q, want a token for %s in eu-west-1", what, pw, want)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("%s sent no password", what)
		}
	}
	ctx := context.Background()
	pool, err := db.Pool(ctx, "test")
	if err != nil {
		t.Fatal(err)
	}
	if err := pool.Ping(ctx); err == nil || !strings.Contains(err.Error(), "password authentication failed") {
		t.Errorf("pool: %v, want the server's refusal", err)
	}
	pool.Close()
	got("the pool")
	if _, err := db.Conn(ctx); err == nil {
		t.Error("conn: logged in to a server that refuses everyone")
	}
	got("the one connection")
	if _, err := replication.ConnectWith(ctx, db.URL, "test", db.Password.Func()); err == nil {
		t.Error("replication: logged in to a server that refuses everyone")
	}
	got("the replication session")
}
