package store

import (
	"fmt"
	"strings"
)

// Class is what a row's last_error says of it, in the word that starts it
// ("rejected: ..."): the one vocabulary the two paths, republish and the
// statements write, and the poller, the console and the statements match.
// A note is written by Note or Notef, matched by Of in Go and by Like in
// SQL; nothing else spells a class.
type Class string

// The classes. The first four are outcomes of an attempt; the others note
// why a row is where it is.
const (
	// ClassRejected: a known non-effect; the broker refused the message,
	// or the row breaks the format (wire.RejectedError's reason follows).
	ClassRejected Class = "rejected"
	// ClassUncertain: the broker may have stored it (a timeout, an outage,
	// a lease that expired); the poller looks it up before it publishes it
	// again (G18).
	ClassUncertain Class = "uncertain"
	// ClassLost: recorded published, and the broker lost it (G19); the
	// poller looks it up too.
	ClassLost Class = "lost"
	// ClassHeld: not attempted; waiting for an earlier row of its
	// aggregate (G12), or too close to its deadline (G13).
	ClassHeld Class = "held"
	// ClassExpired: its deadline passed before it was published (G13).
	ClassExpired Class = "expired"
	// On a published row: the broker already held a message with its ID
	// (ClassDuplicate), an uncertain attempt was found stored
	// (ClassFound), or republish published it again after the broker lost
	// it (ClassRepublished).
	ClassDuplicate   Class = "duplicate"
	ClassFound       Class = "found"
	ClassRepublished Class = "republished"
)

// Classes are every class, in the order above.
var Classes = []Class{ClassRejected, ClassUncertain, ClassLost, ClassHeld, ClassExpired, ClassDuplicate, ClassFound, ClassRepublished}

// Note is a last_error of class c: "c: detail".
func (c Class) Note(detail string) string { return string(c) + ": " + detail }

// Notef is Note with the detail formatted.
func (c Class) Notef(format string, args ...any) string { return c.Note(fmt.Sprintf(format, args...)) }

// Of reports whether lastError is a note of class c.
func (c Class) Of(lastError string) bool { return strings.HasPrefix(lastError, string(c)+":") }

// Like is the SQL condition that the text expression col is a note of
// class c. A LIKE prefix, as the statements always wrote it; the words hold
// none of LIKE's special characters.
func (c Class) Like(col string) string { return col + ` LIKE '` + string(c) + `:%'` }

// SQLNote is the SQL text of a note of class c whose detail is the text
// expression detail: 'c: ' || detail.
func (c Class) SQLNote(detail string) string { return `'` + string(c) + `: ' || ` + detail }

// ClassAndReasonSQL is the SQL expression of a note's class and reason,
// "rejected: max_payload", read from the text expression col (NULL for a
// note without one): what status and the console count failed rows by.
func ClassAndReasonSQL(col string) string { return `substring(` + col + ` FROM '^([a-z]+: [a-z_]+)')` }
