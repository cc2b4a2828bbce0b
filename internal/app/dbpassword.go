package app

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DBPassword is where every new PostgreSQL connection, pooled or
// replication, gets its password when the password changes while the relay
// runs: a secret file that Kubernetes or a Vault agent rewrites on rotation
// (File, read again for each connection), or a command that prints a
// short-lived token (Command, run for each connection: `aws rds
// generate-db-auth-token ...`). Neither set: the password of --database-url
// or of libpq's PGPASSWORD and .pgpass, read once.
type DBPassword struct {
	File    string
	Command string
}

// DBPasswordCommandTimeout bounds one run of --database-password-command: a
// connection waits for it, and a hung token helper must not hang the relay.
const DBPasswordCommandTimeout = 30 * time.Second

// Set reports whether a file or a command gives the password.
func (p DBPassword) Set() bool { return p.File != "" || p.Command != "" }

// Validate refuses both at once, and a file that cannot be read now.
func (p DBPassword) Validate() error {
	if p.File != "" && p.Command != "" {
		return errors.New("--database-password-file and --database-password-command: give one of them")
	}
	if p.File != "" {
		if _, err := p.Get(context.Background()); err != nil {
			return err
		}
	}
	return nil
}

// Get reads the password for one new connection: the file's first line, or
// the command's first line of output, without the line end. The error never
// holds the password; it may hold the command's own error output (its first
// line), which says why a token could not be had.
func (p DBPassword) Get(ctx context.Context) (string, error) {
	switch {
	case p.File != "":
		b, err := os.ReadFile(p.File)
		if err != nil {
			return "", fmt.Errorf("read --database-password-file: %w", err)
		}
		pw := firstLine(b)
		if pw == "" {
			return "", fmt.Errorf("--database-password-file %s is empty", p.File)
		}
		return pw, nil
	case p.Command != "":
		ctx, cancel := context.WithTimeout(ctx, DBPasswordCommandTimeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, "/bin/sh", "-c", p.Command)
		var out, errOut bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errOut
		if err := cmd.Run(); err != nil {
			if ctx.Err() != nil {
				err = fmt.Errorf("no answer in %s", DBPasswordCommandTimeout)
			}
			msg := firstLine(errOut.Bytes())
			if len(msg) > 200 {
				msg = msg[:200] + "..."
			}
			if msg != "" {
				return "", fmt.Errorf("run --database-password-command: %w: %s", err, msg)
			}
			return "", fmt.Errorf("run --database-password-command: %w", err)
		}
		pw := firstLine(out.Bytes())
		if pw == "" {
			return "", errors.New("--database-password-command printed nothing: it must print the password on its first line")
		}
		return pw, nil
	}
	return "", nil
}

func firstLine(b []byte) string {
	line, _, _ := bufio.NewReader(bytes.NewReader(b)).ReadLine()
	return strings.TrimRight(string(line), "\r")
}

// Apply makes every connection of the pool ask for the password as it
// opens.
func (p DBPassword) Apply(pcfg *pgxpool.Config) {
	if !p.Set() {
		return
	}
	pcfg.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
		pw, err := p.Get(ctx)
		if err != nil {
			return err
		}
		cc.Password = pw
		return nil
	}
}

// Func is Get as a function, nil when neither is set (for the replication
// connection: replication.ConnectWith).
func (p DBPassword) Func() func(context.Context) (string, error) {
	if !p.Set() {
		return nil
	}
	return p.Get
}
