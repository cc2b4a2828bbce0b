package main

import (
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"testing"
)

// `status --nats-url` with credentials in a URL the broker cannot be reached
// at, or that does not parse at all, still exits 0 and reports why in
// stream.error, without the secret, in JSON and in text; so does redrive,
// which reads the stream the same way.
func TestStatusHidesNATSSecrets(t *testing.T) {
	url, _ := migrated(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	cases := []struct {
		natsURL, want string
		secrets       []string
	}{
		{"nats://TokSecret1@" + closed, "no servers", []string{"TokSecret1"}},
		{"relay:PassSecret2@" + closed, "no servers", []string{"PassSecret2"}},
		{"nats://relay:Sec3a#Sec3b@" + closed, "invalid port", []string{"Sec3a", "Sec3b"}},
		{"nats://Sec4a%zzSec4b@" + closed, "invalid URL escape", []string{"Sec4a", "Sec4b"}},
		{"nats://relay:Sec5a Sec5b@" + closed, "invalid userinfo", []string{"Sec5a", "Sec5b"}},
		{fmt.Sprintf("nats://TokSecret6@%s, nats://relay:PassSecret7@127.0.0.1:bad", closed), "invalid port", []string{"TokSecret6", "PassSecret7"}},
	}
	for _, c := range cases {
		code, out, errOut := run(t, "status", "--database-url", url, "--nats-url", c.natsURL, "--json")
		if code != 0 {
			t.Errorf("status --json exited %d", code)
		}
		var rep statusReport
		if err := json.Unmarshal([]byte(out), &rep); err != nil {
			t.Fatalf("status --json printed no JSON: %v", err)
		}
		if rep.Stream == nil || !strings.Contains(rep.Stream.Error, c.want) || !strings.Contains(rep.Stream.Error, "xxxxx") {
			t.Errorf("stream.error = %+v, want it to say %q about the redacted URL", rep.Stream, c.want)
		}
		noSecret(t, "status --json", out+errOut, c.secrets...)

		code, out, errOut = run(t, "status", "--database-url", url, "--nats-url", c.natsURL)
		if code != 0 || !strings.Contains(out, c.want) {
			t.Errorf("status exited %d, stdout lacks %q", code, c.want)
		}
		noSecret(t, "status", out+errOut, c.secrets...)

		_, out, errOut = run(t, "redrive", "--database-url", url, "--nats-url", c.natsURL, "--reason", "r", "--work-id", "none")
		if !strings.Contains(errOut, c.want) {
			t.Errorf("redrive's stderr lacks the stream error %q", c.want)
		}
		noSecret(t, "redrive", out+errOut, c.secrets...)
	}
}

func noSecret(t *testing.T, what, text string, secrets ...string) {
	t.Helper()
	for _, s := range secrets {
		if strings.Contains(text, s) {
			t.Errorf("%s shows the secret %q:\n%s", what, s, text)
		}
	}
}
