package rdsiam

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/feature/rds/auth"
)

const (
	testAKID   = "AKIAIOSFODNN7EXAMPLE"
	testSecret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
	testRegion = "us-east-1"
	testHost   = "mydb.123456789012.us-east-1.rds.amazonaws.com"
	testPort   = 5432
	testUser   = "relay"
)

var testTime = time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)

func staticCreds() aws.CredentialsProvider {
	return aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
		return aws.Credentials{AccessKeyID: testAKID, SecretAccessKey: testSecret, Source: "test"}, nil
	})
}

// clock is settable from the test while Token reads it, so it must be
// race-free.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Set(t time.Time) {
	c.mu.Lock()
	c.t = t
	c.mu.Unlock()
}

func mustToken(t *testing.T, s *Source, host string, port uint16, user string) string {
	t.Helper()
	tok, err := s.Token(context.Background(), host, port, user)
	if err != nil {
		t.Fatalf("Token(%s, %d, %s): %v", host, port, user, err)
	}
	return tok
}

func queryOf(t *testing.T, token string) url.Values {
	t.Helper()
	_, raw, ok := strings.Cut(token, "?")
	if !ok {
		t.Fatalf("token has no query string: %s", token)
	}
	q, err := url.ParseQuery(raw)
	if err != nil {
		t.Fatalf("parsing token query: %v", err)
	}
	return q
}

// The expected literal was printed by this package's Token with the inputs
// below, and its signature was then recomputed independently, outside Go, by
// a plain SigV4 implementation (Python hmac/hashlib, following the AWS SigV4
// spec: canonical request "GET\n/\n<sorted query>\nhost:<host:port>\n\nhost\n
// <sha256 of empty body>", scope 20261207/us-east-1/rds-db/aws4_request),
// which gave the same 77f0799c… signature. TestTokenMatchesBuildAuthToken
// additionally checks, at the real clock, that Token and the SDK's own
// auth.BuildAuthToken produce the same token.
func TestTokenKnownAnswer(t *testing.T) {
	s := NewWith(testRegion, staticCreds(), func() time.Time { return testTime })
	got := mustToken(t, s, testHost, testPort, testUser)

	const want = "mydb.123456789012.us-east-1.rds.amazonaws.com:5432/?Action=connect&DBUser=relay" +
		"&X-Amz-Algorithm=AWS4-HMAC-SHA256" +
		"&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20261207%2Fus-east-1%2Frds-db%2Faws4_request" +
		"&X-Amz-Date=20261207T120000Z&X-Amz-Expires=900&X-Amz-SignedHeaders=host" +
		"&X-Amz-Signature=77f0799cdee2d5005b4d25daca0b558cca942e0b3c5faf8d77c39f14338842c7"
	if got != want {
		t.Errorf("token mismatch\n got: %s\nwant: %s", got, want)
	}

	if p := testHost + ":5432/?"; !strings.HasPrefix(got, p) {
		t.Errorf("token does not start with %q: %s", p, got)
	}
	for _, part := range []string{
		"Action=connect",
		"DBUser=relay",
		"X-Amz-Algorithm=AWS4-HMAC-SHA256",
		"X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20261207%2Fus-east-1%2Frds-db%2Faws4_request",
		"X-Amz-Date=20261207T120000Z",
		"X-Amz-Expires=900",
	} {
		if !strings.Contains(got, part) {
			t.Errorf("token lacks %q: %s", part, got)
		}
	}
	if strings.Contains(got, testSecret) || strings.Contains(got, url.QueryEscape(testSecret)) {
		t.Error("token contains the secret key")
	}
}

// BuildAuthToken signs at time.Now and offers no way to pin its clock, so
// the cross-check runs both at the real clock and retries if a second
// boundary fell between the two calls.
func TestTokenMatchesBuildAuthToken(t *testing.T) {
	ctx := context.Background()
	endpoint := testHost + ":5432"
	for attempt := 0; attempt < 5; attempt++ {
		before := time.Now().UTC()
		lib, err := auth.BuildAuthToken(ctx, endpoint, testRegion, testUser, staticCreds())
		if err != nil {
			t.Fatalf("auth.BuildAuthToken: %v", err)
		}
		after := time.Now().UTC()
		if !before.Truncate(time.Second).Equal(after.Truncate(time.Second)) {
			continue
		}
		ours := mustToken(t, NewWith(testRegion, staticCreds(), func() time.Time { return before }), testHost, testPort, testUser)
		// BuildAuthToken leaves the URL path empty ("host:port?Action=…");
		// Token writes the root path ("host:port/?Action=…"), as the AWS CLI
		// does. SigV4 canonicalises an empty path to "/", so the signatures
		// are the same and only that one character differs.
		libWithSlash := strings.Replace(lib, endpoint+"?", endpoint+"/?", 1)
		if ours != libWithSlash {
			t.Fatalf("Token differs from auth.BuildAuthToken at %s\n ours: %s\n  lib: %s", before.Format(time.RFC3339), ours, lib)
		}
		if a, b := queryOf(t, ours).Get("X-Amz-Signature"), queryOf(t, lib).Get("X-Amz-Signature"); a == "" || a != b {
			t.Fatalf("signatures differ: ours %q, lib %q", a, b)
		}
		return
	}
	t.Fatal("could not call BuildAuthToken and Token within one second in 5 attempts")
}

func TestTokenRefresh(t *testing.T) {
	clk := &clock{t: testTime}
	s := NewWith(testRegion, staticCreds(), clk.Now)

	first := mustToken(t, s, testHost, testPort, testUser)

	// 9 minutes in, 6 are left: more than RefreshBefore, so it is reused.
	clk.Set(testTime.Add(9 * time.Minute))
	if got := mustToken(t, s, testHost, testPort, testUser); got != first {
		t.Errorf("at +9m got a new token, want the cached one\n got: %s\nwant: %s", got, first)
	}

	// Other users and ports get their own tokens, signed at their own time.
	otherUser := mustToken(t, s, testHost, testPort, "reader")
	if otherUser == first {
		t.Error("a different user got the same token")
	}
	if d := queryOf(t, otherUser).Get("DBUser"); d != "reader" {
		t.Errorf("other user's token has DBUser=%q", d)
	}
	if d := queryOf(t, otherUser).Get("X-Amz-Date"); d != "20261207T120900Z" {
		t.Errorf("other user's token dated %s, want 20261207T120900Z", d)
	}
	otherPort := mustToken(t, s, testHost, 5433, testUser)
	if otherPort == first || !strings.HasPrefix(otherPort, testHost+":5433/?") {
		t.Errorf("a different port did not get its own token: %s", otherPort)
	}

	// 10m01s in, 4m59s are left: less than RefreshBefore, so a new one.
	clk.Set(testTime.Add(10*time.Minute + time.Second))
	second := mustToken(t, s, testHost, testPort, testUser)
	if second == first {
		t.Fatal("at +10m01s got the old token, want a new one")
	}
	if d := queryOf(t, second).Get("X-Amz-Date"); d != "20261207T121001Z" {
		t.Errorf("refreshed token dated %s, want 20261207T121001Z", d)
	}
	// The refreshed token is now the cached one.
	clk.Set(testTime.Add(11 * time.Minute))
	if got := mustToken(t, s, testHost, testPort, testUser); got != second {
		t.Error("refreshed token was not cached")
	}
	// The other user's token, signed at +9m, still has 13 minutes left.
	if got := mustToken(t, s, testHost, testPort, "reader"); got != otherUser {
		t.Error("other user's token was not kept in the cache")
	}
}

// Temporary credentials (IRSA, ECS/EC2 roles) end the token's validity when
// they expire, even if X-Amz-Expires would allow more.
func TestTokenRefreshWithExpiringCredentials(t *testing.T) {
	clk := &clock{t: testTime}
	creds := aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
		return aws.Credentials{
			AccessKeyID: testAKID, SecretAccessKey: testSecret, SessionToken: "session",
			CanExpire: true, Expires: testTime.Add(7 * time.Minute),
		}, nil
	})
	s := NewWith(testRegion, creds, clk.Now)
	first := mustToken(t, s, testHost, testPort, testUser)
	if q := queryOf(t, first); q.Get("X-Amz-Security-Token") != "session" {
		t.Errorf("token lacks the session token: %s", first)
	}
	clk.Set(testTime.Add(time.Minute)) // 6m of credential life left
	if got := mustToken(t, s, testHost, testPort, testUser); got != first {
		t.Error("at +1m got a new token, want the cached one")
	}
	clk.Set(testTime.Add(3 * time.Minute)) // 4m left: refresh
	if got := mustToken(t, s, testHost, testPort, testUser); got == first {
		t.Error("at +3m got the old token although its credentials expire in 4m")
	}
}

func TestTokenCredentialsError(t *testing.T) {
	errNoCreds := errors.New("no EC2 IMDS role found")
	failing := aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
		return aws.Credentials{}, errNoCreds
	})
	s := NewWith(testRegion, failing, func() time.Time { return testTime })
	tok, err := s.Token(context.Background(), testHost, testPort, testUser)
	if err == nil {
		t.Fatalf("want an error, got token %s", tok)
	}
	if tok != "" {
		t.Errorf("got token %q alongside the error", tok)
	}
	if !errors.Is(err, errNoCreds) {
		t.Errorf("error does not wrap the provider's error: %v", err)
	}
	msg := err.Error()
	for _, want := range []string{"retrieving AWS credentials", "relay", testHost + ":5432", "no EC2 IMDS role found"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q lacks %q", msg, want)
		}
	}
	if strings.Contains(msg, testSecret) {
		t.Errorf("error contains the secret key: %q", msg)
	}

	// A failure must not be cached: once credentials work, tokens come.
	s.creds = staticCreds()
	mustToken(t, s, testHost, testPort, testUser)
}

func TestTokenBadInput(t *testing.T) {
	s := NewWith(testRegion, staticCreds(), func() time.Time { return testTime })
	for _, c := range []struct {
		name string
		host string
		port uint16
		user string
	}{
		{"empty host", "", testPort, testUser},
		{"port 0", testHost, 0, testUser},
		{"empty user", testHost, testPort, ""},
	} {
		if tok, err := s.Token(context.Background(), c.host, c.port, c.user); err == nil {
			t.Errorf("%s: want an error, got token %s", c.name, tok)
		}
	}
	noRegion := NewWith("", staticCreds(), func() time.Time { return testTime })
	if _, err := noRegion.Token(context.Background(), testHost, testPort, testUser); err == nil || !strings.Contains(err.Error(), "region") {
		t.Errorf("empty region: want an error naming the region, got %v", err)
	}
}

func TestTokenConcurrent(t *testing.T) {
	clk := &clock{t: testTime}
	s := NewWith(testRegion, staticCreds(), clk.Now)
	users := []string{"relay", "reader", "admin"}

	var wg sync.WaitGroup
	results := make([][]string, 16)
	for g := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				if g == 0 && i == 25 {
					clk.Set(testTime.Add(time.Minute))
				}
				tok, err := s.Token(context.Background(), testHost, testPort, users[i%len(users)])
				if err != nil {
					t.Error(err)
					return
				}
				results[g] = append(results[g], tok)
			}
		}()
	}
	wg.Wait()

	// Every token for a user must be one of that user's valid tokens; with a
	// one-minute clock step and no refresh due, at most two signing times
	// (00:00 and 01:00) can appear per user.
	seen := map[string]map[string]bool{}
	for _, rs := range results {
		for _, tok := range rs {
			q := queryOf(t, tok)
			u := q.Get("DBUser")
			if seen[u] == nil {
				seen[u] = map[string]bool{}
			}
			seen[u][q.Get("X-Amz-Date")] = true
		}
	}
	for _, u := range users {
		if n := len(seen[u]); n < 1 || n > 2 {
			t.Errorf("user %s: %d distinct signing times, want 1 or 2: %v", u, n, seen[u])
		}
	}
}

// clearAWSEnv makes the default chain find nothing on this machine and
// reach no network: no region, no profile, no shared files, no IMDS.
func clearAWSEnv(t *testing.T) {
	t.Setenv("AWS_REGION", "")
	t.Setenv("AWS_DEFAULT_REGION", "")
	t.Setenv("AWS_PROFILE", "")
	t.Setenv("AWS_CONFIG_FILE", "/nonexistent")
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
}

func TestNewNoRegion(t *testing.T) {
	clearAWSEnv(t)
	s, err := New(context.Background(), "")
	if err == nil {
		t.Fatalf("want an error, got a Source for region %q", s.region)
	}
	for _, want := range []string{"AWS_REGION", "--database-iam-region"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
	}
}

func TestNewRegionOverride(t *testing.T) {
	clearAWSEnv(t)
	t.Setenv("AWS_REGION", "eu-west-1")
	s, err := New(context.Background(), "us-east-2")
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if s.region != "us-east-2" {
		t.Errorf("region %q, want the explicit us-east-2 over AWS_REGION", s.region)
	}

	s, err = New(context.Background(), "")
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if s.region != "eu-west-1" {
		t.Errorf("region %q, want eu-west-1 from AWS_REGION", s.region)
	}
}
