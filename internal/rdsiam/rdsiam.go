// Package rdsiam supplies RDS/Aurora IAM authentication tokens to use as
// PostgreSQL passwords.
//
// With IAM database authentication there is no long-lived password: RDS
// accepts a token for only 15 minutes after it was signed, and checks it only
// when a connection is opened. A connection pool opens connections at any time
// (start-up, reconnects after a failover, growth under load), so every open
// needs a token that is still valid then, not one fetched at start-up. The
// container image ships no cloud CLI to run "aws rds generate-db-auth-token",
// so the relay signs tokens itself. It does so through the AWS SDK rather than
// a hand-written SigV4, so that the credential sources (environment, shared
// files, web identity / IRSA, ECS and EC2 roles) and the signing rules stay the
// SDK's concern.
package rdsiam

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/aws/aws-sdk-go-v2/config"
)

const (
	// TokenLifetime is how long RDS accepts a token after its signing time.
	TokenLifetime = 15 * time.Minute
	// RefreshBefore is how much life a cached token must have left to be
	// handed out again. The margin covers clock skew with AWS and the time a
	// slow TLS/auth handshake takes before RDS checks the token.
	RefreshBefore = 5 * time.Minute
)

const (
	// signingService and emptyPayloadHash are what feature/rds/auth's
	// BuildAuthToken signs with; they are repeated here because that function
	// always signs at time.Now and so cannot be given the Source's clock.
	signingService   = "rds-db"
	emptyPayloadHash = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
)

// Source hands out tokens, one cached per (host, port, user), refreshed
// before it expires. It is safe for concurrent use.
type Source struct {
	region string
	creds  aws.CredentialsProvider
	now    func() time.Time
	// One signer for all calls, so its derived-signing-key cache (one key per
	// day, region and service) is reused instead of recomputed per token.
	signer *v4.Signer

	mu    sync.Mutex
	cache map[cacheKey]cachedToken
}

type cacheKey struct {
	host string
	port uint16
	user string
}

type cachedToken struct {
	token string
	// validUntil is when RDS stops accepting the token: its signing time plus
	// TokenLifetime, or sooner if the credentials it was signed with expire
	// first.
	validUntil time.Time
}

// New loads region and credentials from the standard AWS chain (environment,
// shared config/credentials files, web identity / IRSA, ECS and EC2 roles) via
// config.LoadDefaultConfig. region, when non-empty, overrides the chain's.
// It fails when no region can be found, since a token signed for the wrong
// region is rejected only later, at connect time, with a vague error.
func New(ctx context.Context, region string) (*Source, error) {
	var opts []func(*config.LoadOptions) error
	if region != "" {
		opts = append(opts, config.WithRegion(region))
	}
	cfg, err := config.LoadDefaultConfig(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("rdsiam: loading AWS configuration: %w", err)
	}
	if cfg.Region == "" {
		return nil, errors.New("rdsiam: no AWS region found for IAM database authentication: " +
			"set AWS_REGION (or a region in the shared AWS config profile), or the flag --database-iam-region")
	}
	if cfg.Credentials == nil {
		return nil, errors.New("rdsiam: the AWS configuration has no credentials provider")
	}
	// cfg.Credentials is already an aws.CredentialsCache, so asking it for
	// credentials on every new token does not hit STS/IMDS each time.
	return NewWith(cfg.Region, cfg.Credentials, time.Now), nil
}

// NewWith builds a Source on a fixed credentials provider and clock, so tests
// can pin the signing time and need no AWS environment.
func NewWith(region string, creds aws.CredentialsProvider, now func() time.Time) *Source {
	if now == nil {
		now = time.Now
	}
	return &Source{
		region: region,
		creds:  creds,
		now:    now,
		signer: v4.NewSigner(),
		cache:  make(map[cacheKey]cachedToken),
	}
}

// Token returns a token for user at host:port: the cached one if it has more
// than RefreshBefore of its TokenLifetime left, else a new one signed at the
// Source's current time.
func (s *Source) Token(ctx context.Context, host string, port uint16, user string) (string, error) {
	endpoint := net.JoinHostPort(host, strconv.Itoa(int(port)))
	switch {
	case host == "":
		return "", errors.New("rdsiam: IAM token requested for an empty host")
	case port == 0:
		return "", fmt.Errorf("rdsiam: IAM token requested for %s with port 0", host)
	case user == "":
		return "", fmt.Errorf("rdsiam: IAM token requested for %s with an empty user", endpoint)
	case s.region == "":
		return "", fmt.Errorf("rdsiam: IAM token for user %q at %s: no AWS region set", user, endpoint)
	case s.creds == nil:
		return "", fmt.Errorf("rdsiam: IAM token for user %q at %s: no AWS credentials provider", user, endpoint)
	}

	key := cacheKey{host: host, port: port, user: user}
	now := s.now()

	s.mu.Lock()
	c, ok := s.cache[key]
	s.mu.Unlock()
	if ok && c.validUntil.Sub(now) > RefreshBefore {
		return c.token, nil
	}

	// The lock is not held while fetching credentials and signing: fetching
	// may wait on STS or IMDS, and callers with short contexts must not queue
	// behind it. Concurrent misses may each sign a token; every one of them
	// is valid, so that costs only a few HMACs.
	creds, err := s.creds.Retrieve(ctx)
	if err != nil {
		return "", fmt.Errorf("rdsiam: retrieving AWS credentials for IAM token (user %q at %s): %w", user, endpoint, err)
	}
	token, err := s.sign(ctx, creds, endpoint, user, now)
	if err != nil {
		return "", fmt.Errorf("rdsiam: signing IAM token for user %q at %s: %w", user, endpoint, err)
	}

	// X-Amz-Date has whole seconds, and RDS counts the lifetime from it.
	validUntil := now.UTC().Truncate(time.Second).Add(TokenLifetime)
	// A presigned token dies with the temporary credentials that signed it,
	// whatever X-Amz-Expires says.
	if creds.CanExpire && creds.Expires.Before(validUntil) {
		validUntil = creds.Expires
	}

	s.mu.Lock()
	if cur, ok := s.cache[key]; !ok || validUntil.After(cur.validUntil) {
		s.cache[key] = cachedToken{token: token, validUntil: validUntil}
	}
	s.mu.Unlock()
	return token, nil
}

// sign builds the token as feature/rds/auth.BuildAuthToken does (a SigV4
// presigned GET of https://host:port/?Action=connect&DBUser=user with
// X-Amz-Expires=900 for service "rds-db", scheme stripped), except that the
// signing time is at, which BuildAuthToken does not let a caller choose. The
// one other difference is the explicit "/" path, as in the AWS CLI's tokens:
// BuildAuthToken leaves the path empty, which SigV4 signs as "/" anyway, so
// the signature is the same.
func (s *Source) sign(ctx context.Context, creds aws.Credentials, endpoint, user string, at time.Time) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+endpoint+"/", nil)
	if err != nil {
		// The URL holds only host, port and user; no secret can appear here.
		return "", fmt.Errorf("building request: %w", err)
	}
	q := url.Values{}
	q.Set("Action", "connect")
	q.Set("DBUser", user)
	q.Set("X-Amz-Expires", strconv.Itoa(int(TokenLifetime/time.Second)))
	req.URL.RawQuery = q.Encode()

	signed, _, err := s.signer.PresignHTTP(ctx, creds, req, emptyPayloadHash, signingService, s.region, at.UTC())
	if err != nil {
		return "", fmt.Errorf("presigning: %w", err)
	}
	token, ok := strings.CutPrefix(signed, "https://")
	if !ok {
		return "", errors.New("presigned URL does not start with https://")
	}
	return token, nil
}
