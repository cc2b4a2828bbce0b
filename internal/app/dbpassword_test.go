package app_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/app"
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
