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
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/rdsiam"
	"github.com/outbox-relay/outbox-relay/replication"
)

// DBPassword is where every new PostgreSQL connection, pooled or
// replication, gets its password when the password changes while the relay
// runs: a secret file that Kubernetes or a Vault agent rewrites on rotation
// (File, read again for each connection), or a command that prints a
// short-lived token (Command, run for each connection: `aws rds
// generate-db-auth-token ...`), or an RDS/Aurora IAM token the relay signs
// itself (IAM "aws": the container image has no cloud CLI). None set: the
// password of --database-url or of libpq's PGPASSWORD and .pgpass, read
// once.
type DBPassword struct {
	File    string
	Command string
	// IAM "aws" signs an RDS IAM authentication token for each new
	// connection, for its host, port and user, with the credentials of the
	// standard AWS chain (IRSA included), in IAMRegion or the chain's
	// region; a token is reused until 5 of its 15 minutes are left.
	IAM       string
	IAMRegion string
}

// IAMAWS is --database-iam's one value.
const IAMAWS = "aws"

// DBPasswordCommandTimeout bounds one run of --database-password-command: a
// connection waits for it, and a hung token helper must not hang the relay.
const DBPasswordCommandTimeout = 30 * time.Second

// Set reports whether a file or a command gives the password.
func (p DBPassword) Set() bool { return p.File != "" || p.Command != "" || p.IAM != "" }

// Validate refuses both at once, and a file that cannot be read now.
func (p DBPassword) Validate() error {
	given := 0
	for _, v := range []string{p.File, p.Command, p.IAM} {
		if v != "" {
			given++
		}
	}
	if given > 1 {
		return errors.New("--database-password-file, --database-password-command and --database-iam: give one of them")
	}
	if p.IAM != "" && p.IAM != IAMAWS {
		return fmt.Errorf("--database-iam %q: want aws (an RDS or Aurora IAM authentication token, signed for each new connection)", p.IAM)
	}
	if p.IAMRegion != "" && p.IAM == "" {
		return errors.New("--database-iam-region is for --database-iam aws")
	}
	if p.File != "" {
		if _, err := p.Get(context.Background()); err != nil {
			return err
		}
	}
	if p.IAM != "" {
		if _, err := iamSource(context.Background(), p.IAMRegion); err != nil {
			return err
		}
	}
	return nil
}

// For is the password of one new connection to host:port as user: Get's,
// or an IAM token signed for that endpoint and user.
func (p DBPassword) For(ctx context.Context, host string, port uint16, user string) (string, error) {
	if p.IAM == "" {
		return p.Get(ctx)
	}
	src, err := iamSource(ctx, p.IAMRegion)
	if err != nil {
		return "", err
	}
	tok, err := src.Token(ctx, host, port, user)
	if err != nil {
		return "", fmt.Errorf("--database-iam aws: %w", err)
	}
	return tok, nil
}

// iamSources holds one token source a region: each loads the AWS
// configuration once and keeps the credentials and tokens it has, however
// many copies of the options ask.
var iamSources sync.Map // region -> *iamOnce

type iamOnce struct {
	once sync.Once
	src  *rdsiam.Source
	err  error
}

func iamSource(ctx context.Context, region string) (*rdsiam.Source, error) {
	v, _ := iamSources.LoadOrStore(region, &iamOnce{})
	o := v.(*iamOnce)
	o.once.Do(func() {
		o.src, o.err = rdsiam.New(context.WithoutCancel(ctx), region)
		if o.err != nil {
			o.err = fmt.Errorf("--database-iam aws: %w", o.err)
		}
	})
	return o.src, o.err
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
		pw, err := p.For(ctx, cc.Host, cc.Port, cc.User)
		if err != nil {
			return err
		}
		cc.Password = pw
		return nil
	}
}

// Func is For as a function, nil when none is set (for the replication
// connection: replication.ConnectWith).
func (p DBPassword) Func() replication.PasswordFunc {
	if !p.Set() {
		return nil
	}
	return p.For
}
